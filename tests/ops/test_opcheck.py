"""torch.library.opcheck on every project op: schema, fake impl, autograd registration, aot_dispatch."""
import pytest
import torch

import fusion_compiler.ops  # noqa: F401

fusion = torch.ops.fusion


def _p(*shape, dtype, grad=True):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


_GELU_BIAS = "(1, (('add', (('z',), ('s', 0))), ('gelu', (('v', 0),))), '', False)"
_LSE = "(0, (('tanh', (('z',),)),), 'logsumexp', False)"


def cases(dtype):
    theta = torch.randn(2, 1, 5, 8)
    return [
        (fusion.rms_norm, (_p(3, 5, 40, dtype=dtype), _p(40, dtype=dtype), 1e-6)),
        (fusion.add_rms_norm, (_p(3, 40, dtype=dtype), _p(3, 40, dtype=dtype), _p(40, dtype=dtype), 1e-6)),
        (fusion.layer_norm, (_p(6, 40, dtype=dtype), _p(40, dtype=dtype), _p(40, dtype=dtype), 1e-5)),
        (fusion.layer_norm, (_p(6, 40, dtype=dtype), None, None, 1e-5)),
        (fusion.rope, (_p(2, 3, 5, 8, dtype=dtype), theta.cos().to(dtype), theta.sin().to(dtype), False)),
        (fusion.rope, (_p(2, 3, 5, 8, dtype=dtype), theta[..., :4].cos().to(dtype), theta[..., :4].sin().to(dtype), True)),
        (fusion.glu, (_p(4, 33, dtype=dtype), _p(4, 33, dtype=dtype), "silu")),
        (fusion.glu, (_p(4, 33, dtype=dtype), _p(4, 33, dtype=dtype), "gelu_tanh")),
        (fusion.glu_packed, (_p(4, 66, dtype=dtype), "gelu", True)),
        (fusion.glu_packed, (_p(4, 66, dtype=dtype), "silu", False)),
        (fusion.cross_entropy, (_p(6, 50, dtype=dtype), torch.randint(0, 50, (6,)), -100, "mean", 0.1)),
        (fusion.linear_cross_entropy, (_p(6, 16, dtype=dtype), _p(50, 16, dtype=dtype), None,
                                       torch.randint(0, 50, (6,)), -100, "mean", 0.0, 0.0, True)),
        (fusion.linear_cross_entropy, (_p(6, 16, dtype=dtype), _p(50, 16, dtype=dtype), _p(50, dtype=dtype),
                                       torch.randint(0, 50, (6,)), -100, "sum", 0.0, 5.0, True)),
        (fusion.linear_cross_entropy, (_p(6, 16, dtype=dtype), _p(50, 16, dtype=dtype), _p(50, dtype=dtype),
                                       torch.randint(0, 50, (6,)), 3, "none", 0.0, 5.0, False)),
        (fusion.embedding, (_p(20, 8, dtype=dtype), torch.randint(0, 20, (3, 5)), -1)),
        (fusion.embedding, (_p(20, 8, dtype=dtype), torch.randint(0, 20, (7,)), 2)),
        (fusion.gemm_epilogue, (_GELU_BIAS, _p(3, 5, 24, dtype=dtype), _p(24, 20, dtype=dtype), [_p(20, dtype=dtype)],
                                [3, 5, 20], dtype, True)),
        (fusion.gemm_epilogue, (_LSE, _p(3, 5, 24, dtype=dtype), _p(3, 24, 20, dtype=dtype), [], [3, 5, 20],
                                dtype, True)),
        # routed experts: 7 tokens, top-2 of 3 experts, gated (Triton path) and ungated (grouped_mm path)
        (fusion.moe_experts, (_p(7, 24, dtype=dtype), torch.randint(0, 3, (7, 2)), _p(7, 2, dtype=torch.float32),
                              [_p(3, 40, 24, dtype=dtype), _p(3, 24, 20, dtype=dtype)], "gate_up", "silu", "triton")),
        (fusion.moe_experts, (_p(7, 24, dtype=dtype), torch.randint(0, 3, (7, 2)), _p(7, 2, dtype=torch.float32),
                              [_p(3, 24, 16, dtype=dtype), _p(3, 16, 24, dtype=dtype)], "up_t", "gelu", "grouped_mm")),
        (fusion.topk, (_p(2, 9, 12, dtype=dtype), 3)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index", range(21))
def test_opcheck(dtype, index):
    op, args = cases(dtype)[index]
    torch.library.opcheck(op, args)


def test_opcheck_multi_tensor_ops():
    """The in-place lane program (two lanes, one empty) and the sum of squares."""
    from fusion_compiler.codegen.multi_tensor import Program
    program = Program(("float32",), ("float32",), 1, (("lerp", (("w", 0), ("r", 0), ("s", 0)), "float32"),),
                      ((0, ("v", 0)),)).text()
    reads, writes = [torch.randn(7, 3), torch.randn(0)], [torch.randn(7, 3), torch.randn(0)]
    torch.library.opcheck(fusion.multi_tensor_apply, (program, reads, writes, torch.rand(1, 2)))
    torch.library.opcheck(fusion.multi_tensor_sum_squares, ([torch.randn(5, 2), torch.randn(9)],))


def test_opcheck_fp8_ops():
    """The FP8 linear (casting x itself, or given x's cast) and the ops that cast, in emulate mode. Not
    test_schema (its mutation check compares tensors with ops that have no FP8 kernel on CPU), nor,
    for the ops with FP8 outputs, test_aot_dispatch_dynamic (it sums every output for a backward)."""
    bf16 = torch.bfloat16
    x, w = _p(32, 48, dtype=bf16), _p(16, 48, dtype=bf16)
    q, scale = fusion.fp8_quantize_rows(x.detach(), True)
    checks = ("test_autograd_registration", "test_faketensor")
    for args in [(x, w, "rowwise", True), (x, w, "rowwise", True, q, scale)]:
        torch.library.opcheck(fusion.fp8_linear, args, test_utils=checks + ("test_aot_dispatch_dynamic",))
    casts = [fusion.fp8_quantize_tensorwise(t.detach(), True, True) for t in (x, w)]
    unheld = fusion.fp8_quantize_tensorwise(w.detach(), False, True)  # the backward casts w again
    for w_cast in (casts[1], unheld):
        torch.library.opcheck(fusion.fp8_linear_tensorwise, (x, w, *casts[0], *w_cast, True),
                              test_utils=checks + ("test_aot_dispatch_dynamic",))
    target = torch.randint(0, 16, (32,))
    target[3] = -100
    for w_cast in (casts[1], unheld):  # the LM head fused with its cross-entropy
        torch.library.opcheck(fusion.fp8_linear_tensorwise_cross_entropy,
                              (x, w, *casts[0], *w_cast, target, -100, "mean", True), test_utils=checks)
    for op, args in [(fusion.fp8_quantize_rows, (x, True)), (fusion.fp8_quantize_tensorwise, (x, True, True)),
                     (fusion.fp8_quantize_tensorwise, (x, False, True)),
                     (fusion.rms_norm_fp8, (_p(3, 5, 40, dtype=bf16), _p(40, dtype=bf16), 1e-6)),
                     (fusion.add_rms_norm_fp8, (_p(3, 40, dtype=bf16), _p(3, 40, dtype=bf16), _p(40, dtype=bf16), 1e-6)),
                     (fusion.glu_fp8, (_p(3, 5, 40, dtype=bf16), _p(3, 5, 40, dtype=bf16), "silu")),
                     (fusion.glu_packed_fp8, (_p(3, 80, dtype=bf16), "gelu", True))]:
        torch.library.opcheck(op, args, test_utils=checks)


def test_rope_gradients_reach_cos_and_sin():
    """cos/sin rarely need grads, but when they do the op provides them."""
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    theta = torch.randn(2, 1, 5, 8, dtype=torch.float64)
    for interleaved in (False, True):
        cos = theta[..., :4].cos() if interleaved else theta.cos()
        sin = theta[..., :4].sin() if interleaved else theta.sin()
        cos, sin = cos.float().requires_grad_(), sin.float().requires_grad_()
        y = fusion.rope(x.float(), cos, sin, interleaved)
        g = torch.randn_like(y)
        dc, ds = torch.autograd.grad(y, (cos, sin), g)
        c64, s64 = cos.double().detach().requires_grad_(), sin.double().detach().requires_grad_()
        if interleaved:
            xa, xb = x[..., 0::2], x[..., 1::2]
            ref = torch.stack((xa * c64 - xb * s64, xa * s64 + xb * c64), -1).flatten(-2)
        else:
            ref = x * c64 + torch.cat((-x[..., 4:], x[..., :4]), -1) * s64
        rc, rs = torch.autograd.grad(ref, (c64, s64), g.double())
        assert torch.allclose(dc.double(), rc, atol=1e-4) and torch.allclose(ds.double(), rs, atol=1e-4)


def backward_cases(dtype):
    x, w = torch.randn(6, 40, dtype=dtype), torch.randn(40, dtype=dtype)
    y, rstd = fusion.rms_norm(x, w, 1e-6)
    _, mean, rstd_ln = fusion.layer_norm(x, w, None, 1e-5)
    theta = torch.randn(2, 1, 5, 8)
    return [
        (fusion.rms_norm_backward, (torch.randn_like(y), x, w, rstd, None)),
        (fusion.rms_norm_backward, (torch.randn_like(y), x, w, rstd, torch.randn_like(x))),
        (fusion.layer_norm_backward, (torch.randn_like(x), x, w, mean, rstd_ln)),
        (fusion.layer_norm_backward, (torch.randn_like(x), x, None, mean, rstd_ln)),
        (fusion.rope_backward, (torch.randn(2, 3, 5, 8, dtype=dtype), theta.cos().to(dtype), theta.sin().to(dtype), False)),
        (fusion.glu_backward, (torch.randn(4, 33, dtype=dtype), torch.randn(4, 33, dtype=dtype), torch.randn(4, 33, dtype=dtype), "gelu")),
        (fusion.glu_packed_backward, (torch.randn(4, 33, dtype=dtype), torch.randn(4, 66, dtype=dtype), "silu", True)),
        (fusion.linear_cross_entropy_backward, (torch.randn(6, 16, dtype=dtype), torch.randn(50, 16, dtype=dtype), None,
                                                torch.randint(0, 50, (6,)), torch.randn(6), -100, 0.1, 0.0)),
        (fusion.embedding_backward, (torch.randn(3, 5, 8, dtype=dtype), torch.randint(0, 20, (3, 5)), 20, 4)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index", range(9))
def test_opcheck_backward_ops(dtype, index):
    """The backward ops are ops too (no autograd of their own: double backward is not supported)."""
    op, args = backward_cases(dtype)[index]
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_opcheck_cross_entropy(reduction):
    t = torch.randint(0, 70, (9,))
    t[1] = -100
    torch.library.opcheck(fusion.cross_entropy, (torch.randn(9, 70, requires_grad=True), t, -100, reduction, 0.0))


@pytest.mark.parametrize("impl", ["triton", "grouped_mm"])
@pytest.mark.parametrize("layout", ["up_t", "separate_t", "gate_up"])
def test_moe_backward_fake_has_the_real_strides(layout, impl):
    """Inductor asserts a custom op's output strides against its fake: the transposed layouts' weight
    gradients come back transposed on the grouped_mm path (a bench on the H200 caught this)."""
    from fusion_compiler import _compat
    torch.manual_seed(0)
    weights = {"up_t": [(3, 24, 16), (3, 16, 24)], "separate_t": [(3, 24, 16), (3, 24, 16), (3, 16, 24)],
               "gate_up": [(3, 32, 24), (3, 24, 16)]}[layout]
    x, weight = torch.randn(7, 24), torch.rand(7, 2)
    ws = [torch.randn(s) for s in weights]
    index = torch.randint(0, 3, (7, 2))
    act = "silu" if layout != "up_t" else "gelu"
    out, a1, a1_up, h, perm, offsets, xs = fusion.moe_experts(x, index, weight, ws, layout, act, impl)
    args = (torch.randn_like(out), x, weight, ws, a1, a1_up, h, perm, offsets, layout, act, impl, [True] * (2 + len(ws)),
            False, xs)
    real = fusion.moe_experts_backward(*args)
    with _compat.FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else
                     [mode.from_tensor(t) for t in a] if isinstance(a, list) and a and isinstance(a[0], torch.Tensor)
                     else a for a in args]
        fake = fusion.moe_experts_backward(*fake_args)
    assert [(tuple(r.shape), r.stride()) for r in real] == [(tuple(f.shape), f.stride()) for f in fake]
