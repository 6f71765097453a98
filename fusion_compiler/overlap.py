"""Collective-overlap scheduling: a post-grad pass that hides communication behind compute.

In the post-grad graph Inductor hands its custom passes, functional collectives appear as
`_c10d_functional.<collective>` followed by `wait_tensor` on the result (patterns/collectives.py).
Communication between the two runs while the device computes, so compute placed between them hides
it. On each graph that holds a collective the pass
  1. splits all-gather -> matmul and matmul -> all-reduce / reduce-scatter into chunked pipelines
     where the cost model says the pipeline pays (patterns/collectives.py);
  2. re-orders by list scheduling over the graph's dependencies (a networkx DiGraph of the data
     edges and of the order an in-place write imposes):
       a collective is issued as soon as its inputs are computed, and what it needs is computed
       first, unless that would raise the estimated live memory above the budget;
       otherwise the earliest (original order) ready compute node runs;
       a wait runs only when nothing else can, right before the first node that needs it, or
       earlier when the next node would pass the budget (a wait releases its collective's inputs);
  3. decides each move by the cost model (fusion_compiler/comm_cost.py): a collective whose move
     does not lower its estimated exposed time (communication minus the compute between its issue
     and its wait) is put back in the graph's order (a move that hides nothing only holds memory
     longer), and the graph is scheduled again. The new order is kept unless the graph's total
     exposed time goes up.
Each collective gets a decision row: the move (nodes issued earlier, wait later), the communication
estimate, exposed time before -> after, the estimated peak memory before -> after, for one that
stays exposed the compute that could hide it at most (what neither feeds it nor needs its wait),
and with dynamic shapes the estimate as a formula in the shape symbols and whether the move pays
at every size (sympy) or only at the traced one.
"""
import dataclasses
import math

import networkx as nx
import torch
import torch.fx as fx

from fusion_compiler.patterns import collectives

from . import _compat, comm_cost
from .comm_cost import H100_NVLINK, Costs, LinkProfile
from .cost import nbytes
from .decisions import Decision, location


def _bytes(node: fx.Node) -> int:
    """Bytes of a node's value(s); symbolic sizes at their traced example (no guard)."""
    v = node.meta.get("val")
    return sum(_compat.size_hint(nbytes(t)) for t in (v if isinstance(v, (list, tuple)) else [v]))


def _world() -> int:
    """Ranks of the default group (the estimate's ring size)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 2


def _body(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op in ("call_function", "call_method", "call_module")]


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
            waits = collectives.waits(c) if collectives.is_collective(c) else []
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


def peak_bytes(graph: fx.Graph, order: list[fx.Node]) -> int:
    """The estimated peak of live bytes when the body runs in `order`."""
    live = _Live(graph)
    for n in order:
        live.run(n)
    return live.peak


def dependencies(body: list[fx.Node]) -> nx.DiGraph:
    """Edges a -> n where n must run after a: data edges inside the body and mutation order."""
    index = {n: i for i, n in enumerate(body)}
    deps = nx.DiGraph()
    deps.add_nodes_from(body)
    deps.add_edges_from((a, n) for n in body for a in n.all_input_nodes if a in index)
    deps.add_edges_from((a, n) for n, before in _mutation_order(body, index).items() for a in before)
    return deps


def _first_fed(deps: nx.DiGraph, body: list[fx.Node], targets: set) -> dict:
    """For each node that some target needs (an ancestor of it): the body index of the earliest
    target it feeds, in one reverse topological walk."""
    index = {n: i for i, n in enumerate(body)}
    first: dict = {}
    for n in reversed(list(nx.topological_sort(deps))):
        fed = [first[m] for m in deps.successors(n) if m in first]
        fed += [index[m] for m in deps.successors(n) if m in targets]
        if fed:
            first[n] = min(fed)
    return first


def schedule(graph: fx.Graph, budget_bytes: float = math.inf, pinned: frozenset = frozenset()) -> list[fx.Node]:
    """The new order of the graph's call_function nodes (placeholders and get_attrs stay first, the
    output last). Collectives and what feeds them go first while the live bytes stay within the
    budget; waits go last, unless the next node would take the live bytes over the budget: then a
    ready wait runs first (it releases its collective's inputs). A pinned collective and its wait
    are ordinary compute: they keep the graph's order."""
    body = _body(graph)
    index = {n: i for i, n in enumerate(body)}
    deps = dependencies(body)
    if not nx.is_directed_acyclic_graph(deps):  # a write order no data edge agrees with: keep the graph's
        return body
    waiting = {n: deps.in_degree(n) for n in body}
    ready = {n for n, k in waiting.items() if k == 0}
    live = _Live(graph)
    order = []

    def run(n):
        order.append(n)
        ready.discard(n)
        live.run(n)
        for m in deps.successors(n):
            waiting[m] -= 1
            if waiting[m] == 0:
                ready.add(m)

    moving = {n for n in body if collectives.is_collective(n) and n not in pinned}
    feeds = _first_fed(deps, body, moving)  # what a moving collective needs: the earliest one's first
    while ready:
        candidates = sorted(ready, key=index.get)
        waits = [n for n in candidates if collectives.is_wait(n) and n.args[0] not in pinned]
        early = sorted((n for n in candidates if (n in moving or n in feeds and not collectives.is_wait(n))
                        and live.bytes + _bytes(n) <= budget_bytes), key=lambda n: (feeds.get(n, index[n]), index[n]))
        compute = [n for n in candidates if not (collectives.is_wait(n) and n.args[0] not in pinned)]
        # collectives first, then what they wait on, then other compute
        pick = next((n for n in early if collectives.is_collective(n)), early[0]) if early else \
            compute[0] if compute else None
        if waits and (pick is None or live.bytes + _bytes(pick) > budget_bytes):
            run(waits[0])  # only waits are ready, or the next node would pass the budget: release first
        else:
            run(pick)
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


def windows(order: list[fx.Node]) -> dict:
    """Per collective: the nodes between its issue and its first wait."""
    pos = {n: i for i, n in enumerate(order)}
    result = {}
    for n in order:
        if collectives.is_collective(n):
            end = min((pos[w] for w in collectives.waits(n) if w in pos), default=pos[n] + 1)
            result[n] = order[pos[n] + 1:end]
    return result


def exposed(order: list[fx.Node], costs: Costs) -> dict:
    """Per collective: (comm seconds, compute seconds between issue and first wait), at the hint."""
    return {c: (costs.comm(c), sum(costs.compute(m) for m in between)) for c, between in windows(order).items()}


def _total(estimates: dict) -> float:
    return sum(max(0.0, comm - hidden) for comm, hidden in estimates.values())


def _exposed_before(before: dict, c: fx.Node, comm: float) -> float:
    return max(0.0, comm - before[c][1]) if c in before else comm  # a new chunk: was serial


def _no_gain(after: dict, before: dict) -> frozenset:
    """The collectives whose move hides nothing more."""
    return frozenset(c for c, (comm, hidden) in after.items()
                     if max(0.0, comm - hidden) >= _exposed_before(before, c, comm))


class OverlapPass(_compat.CustomGraphPass):
    """Inductor post-grad custom pass (torch._inductor.config.post_grad_custom_post_pass)."""

    def __init__(self, log, graph_id: int, budget_bytes: float | None = None, link: LinkProfile = H100_NVLINK,
                 chunks: int | None = None):
        self.log, self.graph_id, self.link, self.chunks = log, graph_id, link, chunks
        self.budget = math.inf if budget_bytes is None else budget_bytes
        self.graphs: list[fx.Graph] = []  # the scheduled graphs (tests read them)
        self.estimates: list[tuple[str, float, float, float]] = []  # (collective, comm s, exposed before, after)
        self.peaks: list[tuple[int, int]] = []  # per graph: estimated peak live bytes before, after

    def _row(self, verdict, pattern, reason, kernel, **kw):
        self.log.add(Decision(self.graph_id, pattern, "collectives", verdict, reason, kw.pop("location", ""),
                              kw.pop("inputs", ()), kernel=kernel, **kw))

    def _decompose(self, graph: fx.Graph, costs: Costs) -> None:
        if costs.symbolic:
            self._row("rejected", "decompose_collectives", "dynamic shapes: no chunked decomposition (chunk "
                      "sizes need concrete dims); the reorder prices sizes at their traced example", "")
            return
        for name, k, gain in collectives.decompose_all_gather_matmul(graph, costs, self.chunks):
            self._row("applied", "decompose_all_gather_matmul",
                      f"{name} + matmul in {k} chunks (chunk i's all-gather overlaps chunk i-1's matmul); "
                      f"est. {gain * 1e6:.1f} us saved ({self.link.name})", "all_gather_into_tensor")
        for name, k, gain in collectives.decompose_matmul_reduce(graph, costs, self.chunks):
            self._row("applied", "decompose_matmul_reduce",
                      f"matmul + {name} in {k} column chunks (chunk j's collective overlaps chunk j+1's "
                      f"matmul); est. {gain * 1e6:.1f} us saved ({self.link.name})", name)

    def __call__(self, graph: fx.Graph) -> None:
        if not any(collectives.is_collective(n) for n in graph.nodes):
            return
        costs = Costs(graph, self.link, _world())
        body = _body(graph)
        before, peak_before = exposed(body, costs), peak_bytes(graph, body)
        before_windows = windows(body)
        if self.chunks != 1:
            self._decompose(graph, costs)
            body = _body(graph)
        # every move by the cost model: one that hides nothing more is put back, then schedule again
        order = schedule(graph, self.budget)
        pinned = _no_gain(exposed(order, costs), before)
        if pinned and order != body:
            order = schedule(graph, self.budget, pinned)
        after = exposed(order, costs)
        if _total(after) > _total(before):  # the estimate got worse: the graph keeps its order
            order, after, pinned = body, exposed(body, costs), frozenset(before)
        else:
            apply_order(graph, order)
        peak_after = peak_bytes(graph, order)
        self.peaks.append((peak_before, peak_after))
        deps = dependencies(order)
        old, new = {n: i for i, n in enumerate(body)}, {n: i for i, n in enumerate(order)}
        after_windows = windows(order)
        for c, (comm, hidden) in after.items():
            was, now = _exposed_before(before, c, comm), max(0.0, comm - hidden)
            self.estimates.append((collectives.kind(c), comm, was, now))
            waits = collectives.waits(c)
            moved_wait = (new[waits[0]] - old[waits[0]]) if waits and waits[0] in old else 0
            head = ("kept in the graph's order (moving it hides nothing more)" if c in pinned else
                    f"issued {old.get(c, new[c]) - new[c]} nodes earlier, wait {moved_wait} later")
            reason = (f"{head}; est. comm {comm * 1e6:.1f} us, exposed {was * 1e6:.1f} -> {now * 1e6:.1f} us, "
                      f"peak {peak_before / 2**20:.1f} -> {peak_after / 2**20:.1f} MiB ({self.link.name})")
            if now > 0:
                reason += f"; compute that could hide it: {self._free_compute(deps, c, costs) * 1e6:.1f} us"
            if costs.symbolic:
                reason += self._formula(c, costs, before_windows.get(c, []), after_windows[c])
            verdict = "applied" if now < was and c not in pinned else "rejected"
            self._row(verdict, f"overlap_{collectives.kind(c)}", reason, collectives.kind(c), location=location(c),
                      inputs=(f"{_bytes(c)} B",), time_saved_us=round((was - now) * 1e6, 2))
        self.graphs.append(graph)

    @staticmethod
    def _free_compute(deps: nx.DiGraph, c: fx.Node, costs: Costs) -> float:
        """At most this much compute can sit between c and its wait: what neither feeds c nor needs its wait."""
        bound = nx.ancestors(deps, c) | {c}
        for w in collectives.waits(c):
            bound |= nx.descendants(deps, w) | {w}
        return sum(costs.compute(n) for n in deps if n not in bound)

    @staticmethod
    def _formula(c: fx.Node, costs: Costs, was: list, now: list) -> str:
        """The estimate in the shape symbols; whether the move's gain holds at every size."""
        comm = costs.comm_expr(c)
        hidden_was = sum((costs.compute_expr(n) for n in was), start=0)
        hidden_now = sum((costs.compute_expr(n) for n in now), start=0)
        proved = comm_cost.pays_at_every_size(hidden_now - hidden_was)
        return (f"; symbolic: comm {comm_cost.show(comm)} us, hidden {comm_cost.show(hidden_now)} us; the move "
                + ("pays at every size (sympy)" if proved else "pays at the traced size only"))

    def uuid(self):
        # Inductor's cache key: the pass's code and the settings (a cache hit skips the pass, and
        # reuses the order it produced then; its decision rows are those of the compiling run)
        files = (__file__, comm_cost.__file__, collectives.__file__)
        return (_compat.get_hash_for_files(files), self.budget, dataclasses.astuple(self.link), self.chunks)
