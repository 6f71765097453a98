"""Collective-overlap scheduling: a post-grad pass that issues each collective early and waits late.

In the post-grad graph Inductor hands its custom passes, functional collectives appear as
`_c10d_functional.<collective>` (all_gather_into_tensor, reduce_scatter_tensor, all_reduce, its
in-place all_reduce_ (DTensor), all_to_all_single) followed by `wait_tensor` on the result. Communication between the two runs
while the device computes, so compute placed between them hides it. The pass re-orders the graph
by list scheduling:
  1. a collective is issued as soon as its inputs are computed, and what it needs is computed
     first (unless that would raise the estimated live memory above the budget: then both keep
     their original places);
  2. otherwise the earliest (original order) ready compute node runs;
  3. a wait runs only when nothing else can: right before the first node that needs it.
Before scheduling, all-gather -> matmul and matmul -> all-reduce / reduce-scatter (tensor and
sequence parallel layers) are split into chunks when the cost model says the pipeline pays, so
that one chunk's communication overlaps the next chunk's matmul (micro-pipelining).
The new order is kept unless the estimated exposed time of the graph goes up. Every
collective gets a decision row (applied when its own exposed time goes down): how many nodes moved, the communication estimate (bytes over
the link bandwidth), the compute placed between issue and wait (FLOPs at the matmul rate, bytes at
the memory bandwidth) and the exposed time before and after.
"""
import dataclasses
import math

import torch
import torch.fx as fx

from . import _compat
from .cost import nbytes
from .decisions import Decision, location

COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_reduce_", "all_to_all_single")


@dataclasses.dataclass(frozen=True)
class LinkProfile:
    """What the estimate assumes: per-rank link bandwidth, matmul rate, memory bandwidth."""
    name: str
    link_bytes_s: float
    matmul_flops: float
    memory_bytes_s: float


# H100 SXM: NVLink 4 (~450 GB/s per direction usable for ring collectives), bf16 dense, HBM3 copy
H100_NVLINK = LinkProfile("h100-nvlink", 450e9, 737e12, 3.0e12)


def _name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


def is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and "_c10d_functional" in str(node.target) and _name(node) in COLLECTIVES


def is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and "_c10d_functional" in str(node.target) and _name(node) == "wait_tensor"


def _bytes(node: fx.Node) -> int:
    """Bytes of a node's value(s); symbolic sizes at their traced example (no guard)."""
    v = node.meta.get("val")
    return sum(_compat.size_hint(nbytes(t)) for t in (v if isinstance(v, (list, tuple)) else [v]))


def comm_seconds(node: fx.Node, world: int, link: LinkProfile) -> float:
    """Ring estimate: all-gather / reduce-scatter move (n-1)/n of the full buffer per rank, all-reduce
    twice that, all-to-all (n-1)/n of its input."""
    full = max(_bytes(node), sum(_bytes(a) for a in node.all_input_nodes))
    factor = (world - 1) / world * (2 if _name(node).startswith("all_reduce") else 1)
    return full * factor / link.link_bytes_s


def compute_seconds(node: fx.Node, link: LinkProfile) -> float:
    """A node's time alone: matmul FLOPs at the matmul rate, else bytes in and out at the bandwidth."""
    if node.op != "call_function" or is_collective(node) or is_wait(node):
        return 0.0
    products = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
    if node.target in products or node.target is torch.ops.fusion.gemm_epilogue.default:
        # operands: the last two of mm/addmm/bmm; (epilogue, a, b, ...) of the GEMM + epilogue op
        a, b = (node.args[1], node.args[2]) if node.target not in products else (node.args[-2], node.args[-1])
        a, b = a.meta.get("val"), b.meta.get("val")
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            return 2 * _compat.size_hint(a.numel()) * _compat.size_hint(b.shape[-1]) / link.matmul_flops
    moved = _bytes(node) + sum(_bytes(a) for a in node.all_input_nodes)
    return moved / link.memory_bytes_s


def _world() -> int:
    """Ranks of the default group (the estimate's ring size)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 2


def _symbolic(node: fx.Node) -> bool:
    v = node.meta.get("val")
    return isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in v.shape)


def _waits(node: fx.Node) -> list[fx.Node]:
    return [u for u in node.users if is_wait(u)]


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default)


def _ancestors(nodes: list[fx.Node]) -> set:
    seen, stack = set(), [a for n in nodes for a in n.all_input_nodes]
    while stack:
        n = stack.pop()
        if n not in seen and n.op == "call_function":
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _mutation_order(body: list[fx.Node], index: dict) -> dict:
    """Dependencies no data edge shows: an op that writes into an argument (all_reduce_, copy_) stays
    after that argument's earlier readers and before its later ones."""
    extra: dict = {}
    for n in body:
        schema = getattr(n.target, "_schema", None)
        if schema is None or not schema.is_mutable:
            continue
        for arg, a in zip(schema.arguments, n.args):
            if arg.alias_info is None or not arg.alias_info.is_write or not isinstance(a, fx.Node):
                continue
            for u in a.users:
                if u is n or u not in index:
                    continue
                if index[u] < index[n]:
                    extra.setdefault(n, set()).add(u)
                else:
                    extra.setdefault(u, set()).add(n)
    return extra


class _Live:
    """Bytes alive along a schedule: a value lives from its node until its last user ran; a
    collective's inputs stay alive until its wait (the communication reads them until then)."""

    def __init__(self, graph: fx.Graph):
        self.uses = {n: len(n.users) for n in graph.nodes}
        self.held: dict = {}  # wait -> the inputs of its collective
        self.alias: dict = {}  # wait -> its collective (the wait returns the collective's buffer)
        for c in graph.nodes:
            waits = _waits(c) if is_collective(c) else []
            for w in waits:
                self.alias[w] = c
                self.uses[c] += len(w.users)
            if waits:
                self.held[waits[0]] = list(c.all_input_nodes)
                for a in c.all_input_nodes:
                    self.uses[a] += 1
        self.bytes = sum(_bytes(n) for n in graph.nodes if n.op in ("placeholder", "get_attr"))
        self.peak = self.bytes

    def _release(self, a: fx.Node) -> None:
        a = self.alias.get(a, a)
        self.uses[a] -= 1
        if self.uses[a] == 0 and a.op != "placeholder":
            self.bytes -= _bytes(a)

    def run(self, n: fx.Node) -> None:
        if n not in self.alias:
            self.bytes += _bytes(n)
            self.peak = max(self.peak, self.bytes)
        for a in n.all_input_nodes:
            self._release(a)
        for a in self.held.get(n, ()):
            self._release(a)


def peak_bytes(graph: fx.Graph, order: list[fx.Node]) -> int:
    """The estimated peak of live bytes when the body runs in `order`."""
    live = _Live(graph)
    for n in order:
        live.run(n)
    return live.peak


def schedule(graph: fx.Graph, budget_bytes: float = math.inf) -> list[fx.Node]:
    """The new order of the graph's call_function nodes (placeholders and get_attrs stay first, the
    output last). Collectives and what feeds them go first while the live bytes stay within the
    budget; waits go last, unless the next node would take the live bytes over the budget: then a
    ready wait runs first (it releases its collective's inputs)."""
    body = [n for n in graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    index = {n: i for i, n in enumerate(body)}
    extra = _mutation_order(body, index)
    # what each node waits for inside the body, counted down as it runs (ready set kept incrementally)
    deps = {n: {a for a in n.all_input_nodes if a in index} | extra.get(n, set()) for n in body}
    waiting = {n: len(d) for n, d in deps.items()}
    unblocks: dict = {}
    for n, d in deps.items():
        for a in d:
            unblocks.setdefault(a, []).append(n)
    ready = {n for n, k in waiting.items() if k == 0}
    live = _Live(graph)
    order = []

    def run(n):
        order.append(n)
        ready.discard(n)
        live.run(n)
        for m in unblocks.get(n, ()):
            waiting[m] -= 1
            if waiting[m] == 0:
                ready.add(m)

    feeds = _ancestors([n for n in body if is_collective(n)])
    while ready:
        candidates = sorted(ready, key=index.get)
        early = [n for n in candidates if (is_collective(n) or n in feeds and not is_wait(n))
                 and live.bytes + _bytes(n) <= budget_bytes]
        waits = [n for n in candidates if is_wait(n)]
        compute = [n for n in candidates if not is_wait(n)]
        # collectives first, then what they wait on, then other compute
        pick = next((n for n in early if is_collective(n)), early[0]) if early else \
            compute[0] if compute else None
        if waits and (pick is None or live.bytes + _bytes(pick) > budget_bytes):
            run(waits[0])  # only waits are ready, or the next node would pass the budget: release first
        else:
            run(pick)
    if len(order) != len(body):  # a dependency cycle: keep the graph's order
        return body
    # greedy: an early collective's bytes may still pass the budget later; then the graph's own
    # order, unless that peaks higher still
    if budget_bytes < math.inf and peak_bytes(graph, body) < peak_bytes(graph, order) > budget_bytes:
        return body
    return order


def apply_order(graph: fx.Graph, order: list[fx.Node]) -> None:
    output = next(n for n in graph.nodes if n.op == "output")
    for n in order:  # each moves to just before the output: the body ends up in `order`
        output.prepend(n)
    graph.lint()


def exposed(order: list[fx.Node], link: LinkProfile) -> dict:
    """Per collective: (comm seconds, compute seconds between issue and first wait)."""
    pos = {n: i for i, n in enumerate(order)}
    result = {}
    for n in order:
        if not is_collective(n):
            continue
        waits = _waits(n)
        end = min((pos[w] for w in waits if w in pos), default=pos[n] + 1)
        between = sum(compute_seconds(m, link) for m in order[pos[n] + 1:end])
        result[n] = (comm_seconds(n, _world(), link), between)
    return result


class OverlapPass(_compat.CustomGraphPass):
    """Inductor post-grad custom pass (torch._inductor.config.post_grad_custom_post_pass)."""

    def __init__(self, log, graph_id: int, budget_bytes: float | None = None, link: LinkProfile = H100_NVLINK,
                 chunks: int | None = None):
        self.log, self.graph_id, self.link, self.chunks = log, graph_id, link, chunks
        self.budget = math.inf if budget_bytes is None else budget_bytes
        self.graphs: list[fx.Graph] = []  # the scheduled graphs (tests read them)
        self.estimates: list[tuple[str, float, float, float]] = []  # (collective, comm s, exposed before, after)

    def __call__(self, graph: fx.Graph) -> None:
        if not any(is_collective(n) for n in graph.nodes):
            return
        body = [n for n in graph.nodes if n.op in ("call_function", "call_method", "call_module")]
        before = exposed(body, self.link)
        dynamic = any(_symbolic(n) for n in graph.nodes)
        if dynamic and self.chunks != 1:
            self.log.add(Decision(self.graph_id, "decompose_collectives", "collectives", "rejected",
                                  "dynamic shapes: no chunked decomposition (chunk sizes need concrete dims); "
                                  "the reorder prices sizes at their traced example", "", ()))
        if self.chunks != 1 and not dynamic:
            for name, k, gain in decompose_all_gather_matmul(graph, self.link, self.chunks):
                self.log.add(Decision(
                    self.graph_id, "decompose_all_gather_matmul", "collectives", "applied",
                    f"{name} + matmul in {k} chunks (chunk i's all-gather overlaps chunk i-1's matmul); "
                    f"est. {gain * 1e6:.1f} us saved ({self.link.name})", "", (), kernel="all_gather_into_tensor"))
            for name, k, gain in decompose_matmul_reduce(graph, self.link, self.chunks):
                self.log.add(Decision(
                    self.graph_id, "decompose_matmul_reduce", "collectives", "applied",
                    f"matmul + {name} in {k} column chunks (chunk j's collective overlaps chunk j+1's "
                    f"matmul); est. {gain * 1e6:.1f} us saved ({self.link.name})", "", (), kernel=name))
            body = [n for n in graph.nodes if n.op in ("call_function", "call_method", "call_module")]
        order = schedule(graph, self.budget)
        after = exposed(order, self.link)
        total_before = sum(max(0.0, c - h) for c, h in before.values())
        total_after = sum(max(0.0, c - h) for c, h in after.values())
        if total_after <= total_before:
            apply_order(graph, order)
        else:  # the estimate got worse: the graph keeps its order
            order, after = body, exposed(body, self.link)
        old, new = {n: i for i, n in enumerate(body)}, {n: i for i, n in enumerate(order)}
        for n, (comm, hidden) in after.items():
            was = max(0.0, comm - before[n][1]) if n in before else comm  # a new chunk: was serial
            now = max(0.0, comm - hidden)
            self.estimates.append((_name(n), comm, was, now))
            waits = _waits(n)
            moved_wait = (new[waits[0]] - old[waits[0]]) if waits and waits[0] in old else 0
            moved = old.get(n, new[n]) != new[n] or moved_wait
            note = "" if now < was else "; nothing moves over the wire (one rank)" if comm == 0 else \
                "; no independent compute to hide it behind"
            self.log.add(Decision(
                graph=self.graph_id, pattern=f"overlap_{_name(n)}", family="collectives",
                verdict="applied" if now < was or (comm == 0 and moved) else "rejected",
                reason=(f"issued {old.get(n, new[n]) - new[n]} nodes earlier, wait {moved_wait} later; est. comm "
                        f"{comm * 1e6:.1f} us, exposed {was * 1e6:.1f} -> {now * 1e6:.1f} us ({self.link.name})"
                        + note),
                location=location(n), inputs=(f"{_bytes(n)} B",),
                time_saved_us=round((was - now) * 1e6, 2), kernel=_name(n)))
        self.graphs.append(graph)

    def uuid(self):
        # Inductor's cache key: this file's code and the settings (a cache hit skips the pass, and
        # reuses the order it produced then; its decision rows are those of the compiling run)
        return (_compat.get_hash_for_files((__file__,)), self.budget, dataclasses.astuple(self.link), self.chunks)


# --- decomposition: all-gather -> matmul, and matmul -> all-reduce / reduce-scatter, in chunks ---------
def _fake_call(target, args):
    """Call target on the fake values of args (fx nodes) to get the new node's meta['val']."""
    def fake(a):
        if isinstance(a, (list, tuple)):
            return [fake(b) for b in a]
        return a.meta["val"] if isinstance(a, fx.Node) else a
    vals = [fake(a) for a in args]
    flat = [v for a in vals for v in (a if isinstance(a, list) else [a])]
    mode = next(v.fake_mode for v in flat if isinstance(v, torch.Tensor))
    with mode:
        return target(*vals)


def _emit(graph: fx.Graph, target, *args) -> fx.Node:
    node = graph.call_function(target, tuple(args))
    node.meta["val"] = _fake_call(target, args)
    return node


def chunk_gain(comm_s: float, compute_s: float, chunks: int, launch_s: float = 5e-6) -> float:
    """Seconds saved by k chunks: serial comm + compute becomes one chunk's comm + the slower of the
    two for the rest (the pipeline), paying k - 1 more launches of each."""
    serial = comm_s + compute_s
    pipelined = comm_s / chunks + max(comm_s, compute_s) * (chunks - 1) / chunks + compute_s / chunks
    return serial - pipelined - 2 * (chunks - 1) * launch_s


def _choose_chunks(comm_s: float, compute_s: float, forced: int | None) -> int:
    if forced is not None:
        return forced
    best = max((2, 4, 8), key=lambda k: chunk_gain(comm_s, compute_s, k))
    return best if chunk_gain(comm_s, compute_s, best) > 0 else 1


def decompose_all_gather_matmul(graph: fx.Graph, link: LinkProfile, forced: int | None = None) -> list[tuple]:
    """mm(wait(all_gather(x)), B) -> per chunk of x's rows: all_gather, wait, mm; the gathered rows are
    (rank, chunk, row), so the results are re-interleaved into (rank, row) order. Returns
    (all_gather node name, chunks, est. seconds saved) per rewrite."""
    c10d = torch.ops._c10d_functional
    done = []
    for ag in [n for n in graph.nodes if is_collective(n) and _name(n) == "all_gather_into_tensor"]:
        waits = _waits(ag)
        if len(waits) != 1 or len(waits[0].users) != 1:
            continue
        wait, (mm,) = waits[0], list(waits[0].users)
        x, group_size, group_name = ag.args[:3]
        if mm.target is not torch.ops.aten.mm.default or mm.args[0] is not wait or x.meta["val"].dim() != 2:
            continue
        rows = x.meta["val"].shape[0]
        comm, compute = comm_seconds(ag, group_size, link), compute_seconds(mm, link)
        k = _choose_chunks(comm, compute, forced)
        if k <= 1 or rows % k:
            continue
        with graph.inserting_before(mm):
            parts = []
            for i in range(k):
                piece = _emit(graph, torch.ops.aten.slice.Tensor, x, 0, i * rows // k, (i + 1) * rows // k)
                gathered = _emit(graph, c10d.all_gather_into_tensor.default, piece, group_size, group_name)
                ready = _emit(graph, c10d.wait_tensor.default, gathered)
                out = _emit(graph, torch.ops.aten.mm.default, ready, mm.args[1])
                parts.append(_emit(graph, torch.ops.aten.view.default, out, [group_size, rows // k, -1]))
            joined = _emit(graph, torch.ops.aten.cat.default, parts, 1)
            result = _emit(graph, torch.ops.aten.view.default, joined, list(mm.meta["val"].shape))
        mm.replace_all_uses_with(result)
        for n in (mm, wait, ag):
            graph.erase_node(n)
        done.append((ag.name, k, chunk_gain(comm, compute, k)))
    return done


def decompose_matmul_reduce(graph: fx.Graph, link: LinkProfile, forced: int | None = None) -> list[tuple]:
    """wait(all_reduce | reduce_scatter(mm(A, B))) -> per chunk of B's columns: mm, the collective,
    wait; then the chunks joined along the columns (a reduce-scatter scatters rows, so each rank's
    rows of every chunk line up). Chunk j's collective overlaps chunk j+1's matmul. Returns
    (collective node name, chunks, est. seconds saved) per rewrite."""
    c10d = torch.ops._c10d_functional
    done = []
    for coll in [n for n in graph.nodes if is_collective(n) and _name(n) in ("all_reduce", "all_reduce_",
                                                                            "reduce_scatter_tensor")]:
        src, waits = coll.args[0], _waits(coll)
        # DTensor's rowwise linear reduces the matmul's output viewed back to (batch, seq, N)
        viewed = isinstance(src, fx.Node) and src.target in _VIEWS and len(src.users) == 1
        mm = src.args[0] if viewed else src
        if not (isinstance(mm, fx.Node) and mm.target is torch.ops.aten.mm.default and len(mm.users) == 1
                and len(waits) == 1 and len(coll.users) == 1):
            continue
        cols = mm.meta["val"].shape[1]
        shape = list(src.meta["val"].shape)
        if viewed and shape[-1] != cols:
            continue
        comm, compute = comm_seconds(coll, _world(), link), compute_seconds(mm, link)
        k = _choose_chunks(comm, compute, forced)
        if k <= 1 or cols % k:
            continue
        a, b = mm.args
        with graph.inserting_before(waits[0]):
            parts = []
            for j in range(k):
                bj = _emit(graph, torch.ops.aten.slice.Tensor, b, 1, j * cols // k, (j + 1) * cols // k)
                yj = _emit(graph, torch.ops.aten.mm.default, a, bj)
                if viewed:
                    yj = _emit(graph, torch.ops.aten.view.default, yj, shape[:-1] + [cols // k])
                cj = _emit(graph, coll.target, yj, *coll.args[1:])
                parts.append(_emit(graph, c10d.wait_tensor.default, cj))
            result = _emit(graph, torch.ops.aten.cat.default, parts, -1)
        waits[0].replace_all_uses_with(result)
        for n in (waits[0], coll, *([src] if viewed else []), mm):
            graph.erase_node(n)
        done.append((coll.name, k, chunk_gain(comm, compute, k)))
    return done
