"""The collective scheduler's cost model: ring estimates, compute rates, symbolic sizes (sympy)."""
import pytest
import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from fusion_compiler import comm_cost
from fusion_compiler.comm_cost import Costs, LinkProfile

LINK = LinkProfile("test", link_bytes_s=100e9, matmul_flops=1e15, memory_bytes_s=1e12)


def _node(graph: fx.Graph, target, args, val) -> fx.Node:
    n = graph.call_function(target, args)
    n.meta["val"] = val
    return n


def _placeholder(graph: fx.Graph, name, val) -> fx.Node:
    n = graph.placeholder(name)
    n.meta["val"] = val
    return n


def test_ring_estimates_per_collective():
    c10d = torch.ops._c10d_functional
    g = fx.Graph()
    x = _placeholder(g, "x", torch.empty(1024, 256))  # 1 MiB fp32
    full = torch.empty(4096, 256)
    mib = 2**20
    gather = _node(g, c10d.all_gather_into_tensor.default, (x, 4, "0"), full)
    scatter = _node(g, c10d.reduce_scatter_tensor.default, (_placeholder(g, "f", full), "sum", 4, "0"), x)
    reduce = _node(g, c10d.all_reduce.default, (x, "sum", "0"), x)
    # all-gather / reduce-scatter: (n-1)/n of the full buffer, the group size read from the op
    assert comm_cost.comm_seconds(gather, 8, LINK) == 4 * mib * 3 / 4 / LINK.link_bytes_s
    assert comm_cost.comm_seconds(scatter, 8, LINK) == 4 * mib * 3 / 4 / LINK.link_bytes_s
    # all-reduce: twice (n-1)/n of its buffer, in the default group's size; one rank priced as two
    assert comm_cost.comm_seconds(reduce, 4, LINK) == mib * 2 * 3 / 4 / LINK.link_bytes_s
    assert comm_cost.comm_seconds(reduce, 1, LINK) == comm_cost.comm_seconds(reduce, 2, LINK) > 0


def test_compute_prices_matmuls_by_flops_and_the_rest_by_bytes():
    gm = make_fx(lambda a, b: torch.relu(a @ b))(torch.randn(64, 128), torch.randn(128, 32))
    mm, relu = (n for n in gm.graph.nodes if n.op == "call_function")
    assert comm_cost.compute_seconds(mm, LINK) == 2 * 64 * 128 * 32 / LINK.matmul_flops
    assert comm_cost.compute_seconds(relu, LINK) == 2 * 64 * 32 * 4 / LINK.memory_bytes_s
    c10d = torch.ops._c10d_functional
    wait = _node(gm.graph, c10d.wait_tensor.default, (mm,), mm.meta["val"])
    assert comm_cost.compute_seconds(wait, LINK) == 0


def test_symbolic_sizes_give_formulas_evaluated_at_the_traced_size():
    gm = make_fx(lambda a, b: a @ b, tracing_mode="symbolic")(torch.randn(48, 16), torch.randn(16, 40))
    mm = next(n for n in gm.graph.nodes if n.op == "call_function")
    costs = Costs(gm.graph, LINK, world=2)
    expr = costs.compute_expr(mm)
    assert isinstance(expr, sympy.Basic) and expr.free_symbols and costs.symbolic
    assert costs.compute(mm) == pytest.approx(2 * 48 * 16 * 40 / LINK.matmul_flops)  # at the hint, no guard added
    assert "us" not in comm_cost.show(expr) and str(next(iter(expr.free_symbols))) in comm_cost.show(expr)


def test_a_gain_is_proved_for_every_size_only_when_it_holds():
    s0, s1 = sympy.symbols("s0 s1", positive=True, integer=True)
    assert comm_cost.pays_at_every_size(3 * s0 * s1 + s0)
    assert not comm_cost.pays_at_every_size(s0 - s1)
    assert comm_cost.pays_at_every_size(0.5) and not comm_cost.pays_at_every_size(-1e-9)
