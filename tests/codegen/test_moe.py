"""fusion::moe_experts (codegen/moe.py, codegen/moe_grouped_mm.py) against a float64 loop over tokens:
the output and the gradients of x, the routing weights and every stored expert weight.

Shapes are not multiples of any tile (13 tokens, width 24, expert width 20); routing leaves an expert
without tokens. Tolerances: tests/helpers.py (fp32 1e-5, bf16 1.5e-2).
"""
import pytest
import torch

from fusion_compiler.codegen import moe as kernels
from fusion_compiler.ops import moe as op
from tests.helpers import assert_close, rel_err

ACTS = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu,
        "gelu_tanh": lambda v: torch.nn.functional.gelu(v, approximate="tanh")}


def reference(x, index, weight, weights, layout, act, scale_input=False):
    """out[t] = sum_j weight[t, j] * expert_{index[t, j]}(x[t]) (or expert(weight[t, j] * x[t])), one
    token and slot at a time."""
    w_gate, w_up, w_down = op.views(layout, weights)
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for j in range(index.shape[1]):
            e = int(index[t, j])
            if not 0 <= e < w_gate.shape[0]:
                continue  # out of range: contributes nothing
            xin = weight[t, j] * x[t] if scale_input else x[t]
            h = ACTS[act](w_gate[e] @ xin)
            if w_up is not None:
                h = h * (w_up[e] @ xin)
            acc = acc + (w_down[e] @ h if scale_input else weight[t, j] * (w_down[e] @ h))
        rows.append(acc)
    return torch.stack(rows)


def stored(layout: str, experts: int, width: int, ffn: int, dtype) -> list:
    base, transposed = op.parse_layout(layout)
    shapes = {"gate_up": [(experts, 2 * ffn, width), (experts, width, ffn)],
              "gate_up_interleaved": [(experts, 2 * ffn, width), (experts, width, ffn)],
              "separate": [(experts, ffn, width), (experts, ffn, width), (experts, width, ffn)],
              "up": [(experts, ffn, width), (experts, width, ffn)]}[base]
    ws = [torch.randn(s, dtype=dtype) * s[-1] ** -0.5 for s in shapes]
    return [w.transpose(1, 2).contiguous() if transposed else w for w in ws]


def routing(tokens: int, experts: int, top_k: int, empty_expert: bool = True):
    logits = torch.randn(tokens, experts)
    if empty_expert:
        logits[:, -1] = -1e4  # the last expert gets no token
    weight, index = logits.softmax(-1).topk(top_k, -1)
    return index, weight / weight.sum(-1, keepdim=True)


def check(layout, act, impl, dtype, tokens=13, width=24, ffn=20, experts=5, top_k=2, index=None, weight=None,
          scale_input=False, column_major=False):
    x = torch.randn(width, tokens, dtype=dtype).t() if column_major else torch.randn(tokens, width, dtype=dtype)
    if index is None:
        index, weight = routing(tokens, experts, top_k)
    ws = stored(layout, experts, width, ffn, dtype)
    leaves = [x.clone().requires_grad_(), weight.clone().requires_grad_()] + [w.clone().requires_grad_() for w in ws]
    outs = torch.ops.fusion.moe_experts(leaves[0], index, leaves[1], leaves[2:], layout, act, impl, scale_input)
    out = outs[0]
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = reference(ref_leaves[0], index, ref_leaves[1], ref_leaves[2:], layout, act, scale_input)
    dout = torch.randn_like(ref)
    grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, ref, dtype, "out")
    for name, g, r in zip(["x", "weight"] + [f"weights[{i}]" for i in range(len(ws))], grads, ref_grads):
        assert g.shape == r.shape and g.dtype == leaves[0].dtype or name == "weight"
        assert_close(g, r, dtype, f"d {name}", factor=2.0 if dtype != torch.float32 else 1.0)
    return outs


@pytest.mark.parametrize("layout", ["gate_up", "gate_up_t", "gate_up_interleaved", "separate", "separate_t", "up",
                                   "up_t"])
@pytest.mark.parametrize("impl", ["triton", "grouped_mm"])
def test_layouts_fp32(layout, impl):
    check(layout, "silu", impl, torch.float32, width=24, ffn=20)


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh"])
@pytest.mark.parametrize("layout", ["gate_up", "up"])
def test_activations(act, layout):
    check(layout, act, "triton", torch.float32)
    check(layout, act, "grouped_mm", torch.float32, width=24, ffn=20)


@pytest.mark.parametrize("impl", ["triton", "grouped_mm"])
def test_bf16(impl):
    """bf16 operands against float64; the bf16 output also matches eager's own bf16 spelling."""
    check("gate_up", "silu", impl, torch.bfloat16, width=32, ffn=24)


@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_expert_width_over_one_column_block(act):
    """The grouped_mm path's GLU backward loops over column blocks of the expert width (256 under the
    interpreter): 300 takes two, the second partly masked."""
    check("gate_up", act, "grouped_mm", torch.float32, tokens=9, width=16, ffn=300, experts=3)


@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("impl", ["triton", "grouped_mm"])
def test_top_k_and_odd_token_counts(top_k, impl):
    check("gate_up", "silu", impl, torch.float32, tokens=7 if top_k == 8 else 17, experts=9, top_k=top_k)


def test_grouped_mm_path_is_taken_where_it_can_run_and_triton_otherwise():
    x, w13, wd = torch.randn(4, 24), torch.randn(3, 40, 24), torch.randn(3, 24, 20)
    assert op.resolve_impl("grouped_mm", x, "gate_up", [w13, wd]) == "grouped_mm"
    assert op.resolve_impl("triton", x, "gate_up", [w13, wd]) == "triton"
    assert op.resolve_impl("grouped_mm", x, "separate", [w13[:, :20], w13[:, 20:], wd]) == "grouped_mm"
    assert op.resolve_impl("grouped_mm", x, "gate_up_interleaved", [w13, wd]) == "triton"
    odd = torch.randn(4, 23)  # a 92-byte row: not 16-byte aligned
    assert op.resolve_impl("grouped_mm", odd, "gate_up", [torch.randn(3, 40, 23), torch.randn(3, 23, 20)]) == "triton"
    outs = check("gate_up", "silu", "grouped_mm", torch.float32)
    assert outs[6].shape == (26, 24)  # the grouped_mm path saves the gathered token rows
    assert outs[1].shape == (26, 40) and outs[2].numel() == 0  # gate and up products in one tensor
    outs = check("separate", "silu", "grouped_mm", torch.float32, width=24, ffn=20)
    assert outs[1].shape == outs[2].shape == (26, 20)  # weights apart: the two products kept apart
    outs = check("gate_up", "silu", "triton", torch.float32)
    assert outs[6].numel() == 0 and outs[2].numel() == 0


@pytest.mark.parametrize("impl", ["triton", "grouped_mm"])
def test_every_token_on_one_expert_and_experts_without_tokens(impl):
    index = torch.full((11, 2), 3)
    index[:, 1] = 0
    weight = torch.rand(11, 2)
    check("gate_up", "silu", impl, torch.float32, tokens=11, experts=6, index=index, weight=weight)


@pytest.mark.parametrize("impl", ["triton", "grouped_mm"])
@pytest.mark.parametrize("sentinel", [4, -1])
def test_out_of_range_expert_ids_contribute_nothing(impl, sentinel):
    """HF's expert-parallel sentinels (id >= E) and negative ids are dropped: their slot adds 0 and gets
    no gradient (a -1 once sorted first, into grouped_mm's first group: expert 0's)."""
    index, weight = routing(9, 4, 2)
    index[::3, 1] = sentinel
    check("gate_up", "silu", impl, torch.float32, tokens=9, experts=4, index=index, weight=weight)


@pytest.mark.parametrize("layout", ["gate_up", "separate_t", "up"])
def test_routing_weights_on_the_experts_input(layout):
    """torchtitan's score-before-experts: sum_j expert(weight * x), every gradient (grouped_mm path)."""
    check(layout, "silu", "grouped_mm", torch.float32, scale_input=True)


def test_routing_weights_on_the_input_rows_wider_than_a_block():
    """The input weight's gradient is summed over the combine's column blocks' partial dots (256 wide
    under the interpreter) when the width spans several: 300 takes two."""
    check("gate_up", "silu", "grouped_mm", torch.float32, tokens=9, width=300, ffn=20, experts=3, scale_input=True)


def test_routing_weight_gradient_alone_on_the_input():
    """x frozen, the routing weights not: their gradient alone (the combine's dots), no dx."""
    x, (index, weight) = torch.randn(7, 24), routing(7, 3, 2)
    ws = stored("gate_up", 3, 24, 20, torch.float32)
    weight = weight.clone().requires_grad_()
    out = torch.ops.fusion.moe_experts(x, index, weight, ws, "gate_up", "silu", "grouped_mm", True)[0]
    dout = torch.randn_like(out)
    (dweight,) = torch.autograd.grad(out, [weight], dout)
    ref_weight = weight.detach().double().requires_grad_()
    ref = reference(x.double(), index, ref_weight, [w.double() for w in ws], "gate_up", "silu", scale_input=True)
    (ref_dweight,) = torch.autograd.grad(ref, [ref_weight], dout.double())
    assert rel_err(out, ref) <= 1e-5 and rel_err(dweight, ref_dweight) <= 1e-5


def test_routing_weights_on_the_input_need_the_grouped_mm_path():
    x, (index, weight) = torch.randn(5, 24), routing(5, 3, 2)
    w13, wd = torch.randn(3, 40, 24), torch.randn(3, 24, 20)
    with pytest.raises(ValueError, match="grouped_mm path only"):
        torch.ops.fusion.moe_experts(x, index, weight, [w13, wd], "gate_up_interleaved", "silu", "grouped_mm", True)


@pytest.mark.parametrize("impl", ["triton", "grouped_mm"])
def test_column_major_input(impl):
    """A transposed activation (x's rows not unit-stride) is read through its strides or copied first."""
    x_t, ws = torch.randn(24, 16).t(), stored("gate_up", 5, 24, 20, torch.float32)
    assert op.resolve_impl(impl, x_t, "gate_up", ws) == impl  # 16 tokens: x's row stride 16-byte aligned
    check("gate_up", "silu", impl, torch.float32, tokens=16, width=24, column_major=True)


def test_no_gradient_work_for_frozen_inputs():
    x, (index, weight) = torch.randn(6, 24), routing(6, 3, 2)
    w13, wd = torch.randn(3, 40, 24, requires_grad=True), torch.randn(3, 24, 20)
    out = torch.ops.fusion.moe_experts(x, index, weight, [w13, wd], "gate_up", "silu", "triton")[0]
    (dw13,) = torch.autograd.grad(out, [w13], torch.randn_like(out))
    ref = reference(x.double(), index, weight.double(), [w13.detach().double().requires_grad_(), wd.double()],
                    "gate_up", "silu")
    assert rel_err(out, ref) <= 1e-5 and dw13.shape == w13.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_sorts_by_expert_without_host_sync(dtype):
    """The sort, and the per-row tables made from it in one kernel: token, weight (fp32) in sorted
    and in slot order, and the inverse permutation."""
    index, weight = torch.tensor([[2, 0], [1, 2], [0, 3]]), torch.rand(3, 2).to(dtype)
    r = kernels.route(index, weight, 4)
    assert r.offsets.tolist() == [0, 2, 3, 5, 6]
    assert [int(index.reshape(-1)[p]) for p in r.perm] == [0, 0, 1, 2, 2, 3]
    assert r.token.tolist() == (r.perm // 2).tolist()
    assert r.inverse[r.perm.long()].tolist() == list(range(6))
    assert torch.equal(r.slot_weight, weight.reshape(-1).float())
    assert torch.equal(r.weight, weight.reshape(-1).float()[r.perm.long()])
    table = kernels.tiles(r, 2)  # expert, first row, end row of every 2-row tile (+ empty spares)
    busy = [tuple(c) for c in table.t().tolist() if c[1] < c[2]]
    assert busy == [(0, 0, 2), (1, 2, 3), (2, 3, 5), (3, 5, 6)]


@pytest.mark.parametrize("experts", [4, 200, 40000])
def test_route_on_a_narrow_key_keeps_the_int64_order(experts):
    """The sort runs on int8 / int16 / int32 ids; sentinels far outside [0, E) (which would wrap in a
    narrow type unclamped) stay outside every expert's range and the order stays stable."""
    index = torch.randint(0, experts, (37, 3))
    index[::5, 0] = 2**32 + 1  # id 1 in int8, int16 and int32 if cast unclamped
    index[1::7, 2] = -1
    r = kernels.route(index, torch.rand(37, 3), experts)
    flat = index.reshape(-1)
    expected = torch.sort(flat, stable=True).indices
    inside = (flat[expected] >= 0) & (flat[expected] < experts)
    kept = r.perm.long()[:r.offsets[-1]]
    assert kept.tolist() == expected[inside].tolist()
    assert r.offsets.tolist() == [int(((flat >= 0) & (flat < e)).sum()) for e in range(experts + 1)]
    assert index[1, 2] == -1  # the caller's ids are not touched


def test_route_tables_over_several_programs():
    """2100 rows: the tables kernel's three programs of 1024 rows, the last one partial."""
    index, weight = torch.randint(0, 8, (700, 3)), torch.rand(700, 3)
    r = kernels.route(index, weight, 8)
    perm = r.perm.long()
    assert sorted(perm.tolist()) == list(range(2100)) and r.inverse[perm].tolist() == list(range(2100))
    assert torch.equal(r.token.long(), perm // 3) and torch.equal(r.weight, weight.reshape(-1)[perm])


def test_bad_operands_raise_clear_errors():
    x, (index, weight) = torch.randn(5, 24), routing(5, 3, 2)
    w13, wd = torch.randn(3, 40, 24), torch.randn(3, 24, 20)
    with pytest.raises(ValueError, match="unknown weight layout"):
        torch.ops.fusion.moe_experts(x, index, weight, [w13, wd], "gate_up_x", "silu", "triton")
    with pytest.raises(ValueError, match="takes 3 weight tensors"):
        torch.ops.fusion.moe_experts(x, index, weight, [w13, wd], "separate", "silu", "triton")
    with pytest.raises(ValueError, match="do not fit"):
        torch.ops.fusion.moe_experts(x, index, weight, [w13, torch.randn(3, 20, 24)], "gate_up", "silu", "triton")
    with pytest.raises(ValueError, match="activation"):
        torch.ops.fusion.moe_experts(x, index, weight, [w13, wd], "gate_up", "relu6", "triton")
    with pytest.raises(ValueError, match="x's dtype"):
        torch.ops.fusion.moe_experts(x, index, weight, [w13.double(), wd.double()], "gate_up", "silu", "triton")
