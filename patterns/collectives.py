"""The collectives family: what the overlap pass (fusion_compiler/overlap.py) finds in the post-grad
ATen graph, and the rewrites that split a collective and its matmul into a pipeline.

Matched here:
  collective      `_c10d_functional.<collective>` (all_gather_into_tensor, reduce_scatter_tensor,
                  all_reduce, DTensor's in-place all_reduce_, all_to_all_single); its `wait_tensor`
  all-gather -> matmul                   (sequence parallel / FSDP: a gathered operand read by one mm)
      before:  y = mm(wait(all_gather(x)), B)
      after:   per chunk i of x's rows: y_i = mm(wait(all_gather(x_i)), B); y = rows re-interleaved
  matmul -> all-reduce / reduce-scatter  (tensor parallel row-wise linears)
      before:  y = wait(all_reduce(mm(A, B)))
      after:   per chunk j of B's columns: y_j = wait(all_reduce(mm(A, B_j))); y = cat(y_j, -1)
A split is taken when the pipeline's estimated gain (`chunk_gain`, the overlap pass's cost model)
is positive for the chosen number of chunks, or when the user forces a number.
"""
import torch
import torch.fx as fx

from fusion_compiler.comm_cost import Costs

COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_reduce_", "all_to_all_single")
_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default)


def kind(node: fx.Node) -> str:
    """all_reduce, all_gather_into_tensor, wait_tensor, ... (the op's name without its overload)."""
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


def is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and "_c10d_functional" in str(node.target) and kind(node) in COLLECTIVES


def is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and "_c10d_functional" in str(node.target) and kind(node) == "wait_tensor"


def waits(node: fx.Node) -> list[fx.Node]:
    return [u for u in node.users if is_wait(u)]


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


def decompose_all_gather_matmul(graph: fx.Graph, costs: Costs, forced: int | None = None) -> list[tuple]:
    """mm(wait(all_gather(x)), B) -> per chunk of x's rows: all_gather, wait, mm; the gathered rows are
    (rank, chunk, row), so the results are re-interleaved into (rank, row) order. Returns
    (all_gather node name, chunks, est. seconds saved) per rewrite."""
    c10d = torch.ops._c10d_functional
    done = []
    for ag in [n for n in graph.nodes if is_collective(n) and kind(n) == "all_gather_into_tensor"]:
        ws = waits(ag)
        if len(ws) != 1 or len(ws[0].users) != 1:
            continue
        wait, (mm,) = ws[0], list(ws[0].users)
        x, group_size, group_name = ag.args[:3]
        if mm.target is not torch.ops.aten.mm.default or mm.args[0] is not wait or x.meta["val"].dim() != 2:
            continue
        rows = x.meta["val"].shape[0]
        comm, compute = costs.comm(ag), costs.compute(mm)
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


def decompose_matmul_reduce(graph: fx.Graph, costs: Costs, forced: int | None = None) -> list[tuple]:
    """wait(all_reduce | reduce_scatter(mm(A, B))) -> per chunk of B's columns: mm, the collective,
    wait; then the chunks joined along the columns (a reduce-scatter scatters rows, so each rank's
    rows of every chunk line up). Chunk j's collective overlaps chunk j+1's matmul. Returns
    (collective node name, chunks, est. seconds saved) per rewrite."""
    c10d = torch.ops._c10d_functional
    done = []
    for coll in [n for n in graph.nodes if is_collective(n) and kind(n) in ("all_reduce", "all_reduce_",
                                                                            "reduce_scatter_tensor")]:
        src, ws = coll.args[0], waits(coll)
        # DTensor's rowwise linear reduces the matmul's output viewed back to (batch, seq, N)
        viewed = isinstance(src, fx.Node) and src.target in _VIEWS and len(src.users) == 1
        mm = src.args[0] if viewed else src
        if not (isinstance(mm, fx.Node) and mm.target is torch.ops.aten.mm.default and len(mm.users) == 1
                and len(ws) == 1 and len(coll.users) == 1):
            continue
        cols = mm.meta["val"].shape[1]
        shape = list(src.meta["val"].shape)
        if viewed and shape[-1] != cols:
            continue
        comm, compute = costs.comm(coll), costs.compute(mm)
        k = _choose_chunks(comm, compute, forced)
        if k <= 1 or cols % k:
            continue
        a, b = mm.args
        with graph.inserting_before(ws[0]):
            parts = []
            for j in range(k):
                bj = _emit(graph, torch.ops.aten.slice.Tensor, b, 1, j * cols // k, (j + 1) * cols // k)
                yj = _emit(graph, torch.ops.aten.mm.default, a, bj)
                if viewed:
                    yj = _emit(graph, torch.ops.aten.view.default, yj, shape[:-1] + [cols // k])
                cj = _emit(graph, coll.target, yj, *coll.args[1:])
                parts.append(_emit(graph, c10d.wait_tensor.default, cj))
            result = _emit(graph, torch.ops.aten.cat.default, parts, -1)
        ws[0].replace_all_uses_with(result)
        for n in (ws[0], coll, *([src] if viewed else []), mm):
            graph.erase_node(n)
        done.append((coll.name, k, chunk_gain(comm, compute, k)))
    return done
