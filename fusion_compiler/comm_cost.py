"""The collective scheduler's cost model: communication over the link, and the compute that hides it.

Each estimate is a sympy expression in the graph's shape symbols: a graph traced with dynamic shapes
keeps its SymInts' symbols (s0, s1, ...), a static graph gives plain numbers. A decision row can
therefore show a formula, and a move whose gain is non-negative for every size is proved so
(`pays_at_every_size`). Orders are compared at the traced example (`Costs.at_hint`), which adds no
guard to the graph.
  communication   ring estimate: all-gather / reduce-scatter move (n-1)/n of the full buffer per
                  rank, all-reduce twice that, all-to-all (n-1)/n of its input; over the link
  compute         a matmul's FLOPs at the matmul rate; any other op's bytes in and out at the
                  memory bandwidth; communication ops (the functional collectives, their waits) none
"""
import dataclasses
import math

import sympy
import torch
import torch.fx as fx

from . import _compat


@dataclasses.dataclass(frozen=True)
class LinkProfile:
    """What the estimate assumes: per-rank link bandwidth, matmul rate, memory bandwidth."""
    name: str
    link_bytes_s: float
    matmul_flops: float
    memory_bytes_s: float


# H100 SXM: NVLink 4 (~450 GB/s per direction usable for ring collectives), bf16 dense, HBM3 copy
H100_NVLINK = LinkProfile("h100-nvlink", 450e9, 737e12, 3.0e12)

_PRODUCTS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


def _size(d):
    """A dimension: a Python int when static, its sympy expression when symbolic."""
    return _compat.sym_expr(d) if isinstance(d, torch.SymInt) else int(d)


def _numel(t: torch.Tensor):
    return math.prod((_size(d) for d in t.shape), start=1)


def tensor_bytes(node: fx.Node):
    """Bytes of a node's tensor value(s)."""
    v = node.meta.get("val")
    return sum(_numel(t) * t.element_size() for t in (v if isinstance(v, (list, tuple)) else [v])
               if isinstance(t, torch.Tensor))


def _max(a, b):
    return sympy.Max(a, b) if isinstance(a, sympy.Basic) or isinstance(b, sympy.Basic) else max(a, b)


def is_communication(node: fx.Node) -> bool:
    return node.op == "call_function" and "_c10d_functional" in str(node.target)


def comm_seconds(node: fx.Node, world: int, link: LinkProfile):
    """`world`: the default group's size, for collectives that do not name their group's size."""
    full = _max(tensor_bytes(node), sum(tensor_bytes(a) for a in node.all_input_nodes))
    name = getattr(node.target, "__name__", str(node.target))
    sized = {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 2}.get(name.split(".")[0])
    if sized is not None and len(node.args) > sized and isinstance(node.args[sized], int):
        world = node.args[sized]
    world = max(world, 2)  # a one-rank group is priced as two: the layout runs on more
    factor = (world - 1) / world * (2 if name.startswith("all_reduce") else 1)
    return full * factor / link.link_bytes_s


def compute_seconds(node: fx.Node, link: LinkProfile):
    """A node's time alone (0 for placeholders, communication and waits)."""
    if node.op != "call_function" or is_communication(node):
        return 0
    if node.target in _PRODUCTS or node.target is torch.ops.fusion.gemm_epilogue.default:
        # operands: the last two of mm/addmm/bmm; (epilogue, a, b, ...) of the GEMM + epilogue op
        a, b = (node.args[-2], node.args[-1]) if node.target in _PRODUCTS else (node.args[1], node.args[2])
        a, b = a.meta.get("val"), b.meta.get("val")
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            return 2 * _numel(a) * _size(b.shape[-1]) / link.matmul_flops
    moved = tensor_bytes(node) + sum(tensor_bytes(a) for a in node.all_input_nodes)
    return moved / link.memory_bytes_s


def pays_at_every_size(gain) -> bool:
    """True when sympy proves a symbolic gain >= 0 for all positive sizes (a number: its sign)."""
    if not isinstance(gain, sympy.Basic):
        return gain >= 0
    return bool(sympy.simplify(gain).is_nonnegative)


def show(expr, digits: int = 3) -> str:
    """A formula for a decision row, in microseconds."""
    return str(sympy.N(sympy.sympify(expr) * 10**6, digits))


class Costs:
    """Per-node estimates of one graph, cached: the expression and its value at the traced example."""

    def __init__(self, graph: fx.Graph, link: LinkProfile, world: int):
        self.link, self.world = link, world
        self.hints: dict = {}  # each shape symbol -> the size the graph was traced at
        for n in graph.nodes:
            v = n.meta.get("val")
            for t in v if isinstance(v, (list, tuple)) else [v]:
                for d in getattr(t, "shape", ()) if isinstance(t, torch.Tensor) else ():
                    if isinstance(d, torch.SymInt) and _compat.sym_expr(d).is_Symbol:
                        self.hints[_compat.sym_expr(d)] = _compat.size_hint(d)
        self.symbolic = bool(self.hints)
        self._compute: dict = {}
        self._comm: dict = {}

    def at_hint(self, expr) -> float:
        if not isinstance(expr, sympy.Basic):
            return float(expr)
        value = expr.xreplace(self.hints)
        return float(value.xreplace({s: 4096 for s in value.free_symbols}))  # unbacked: a guess

    def compute_expr(self, node: fx.Node):
        if node not in self._compute:
            e = compute_seconds(node, self.link)
            self._compute[node] = (e, self.at_hint(e))
        return self._compute[node][0]

    def compute(self, node: fx.Node) -> float:
        self.compute_expr(node)
        return self._compute[node][1]

    def comm_expr(self, node: fx.Node):
        if node not in self._comm:
            e = comm_seconds(node, self.world, self.link)
            self._comm[node] = (e, self.at_hint(e))
        return self._comm[node][0]

    def comm(self, node: fx.Node) -> float:
        self.comm_expr(node)
        return self._comm[node][1]

    def bytes(self, node: fx.Node) -> int:
        return int(self.at_hint(tensor_bytes(node)))
