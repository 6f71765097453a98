"""Canonicalization: many spellings, one ATen form."""
import torch
import torch.nn.functional as F

from fusion_compiler.canonical import trace_function

aten = torch.ops.aten


def targets(fn, *args):
    gm = trace_function(fn, list(args))
    return [n.target for n in gm.graph.nodes if n.op == "call_function"], gm


def test_square_spellings_become_pow():
    x = torch.randn(3, 5)
    for fn in (lambda x: x * x, lambda x: x ** 2, lambda x: torch.square(x), lambda x: x.pow(2)):
        t, _ = targets(fn, x)
        assert t == [aten.pow.Tensor_Scalar], t


def test_reciprocal_sqrt_spellings_become_rsqrt():
    v = torch.rand(3, 5) + 0.5
    for fn in (lambda v: 1 / torch.sqrt(v), lambda v: torch.reciprocal(v.sqrt()), lambda v: torch.rsqrt(v)):
        t, _ = targets(fn, v)
        assert t == [aten.rsqrt.default], t
    t, _ = targets(lambda a, v: a / torch.sqrt(v), torch.randn(3, 5), v)
    assert aten.mul.Tensor in t and aten.rsqrt.default in t and aten.div.Tensor not in t


def test_sigmoid_times_self_becomes_silu():
    for fn in (lambda g: g * torch.sigmoid(g), lambda g: torch.sigmoid(g) * g, lambda g: F.silu(g)):
        t, _ = targets(fn, torch.randn(4, 6))
        assert t == [aten.silu.default], t


def test_dims_are_negative_and_defaults_filled():
    _, gm = targets(lambda x: x.mean(2, keepdim=True), torch.randn(2, 3, 4))
    [mean] = [n for n in gm.graph.nodes if n.target is aten.mean.dim]
    assert mean.args[1] == [-1] and mean.kwargs == {"dtype": None}
    _, gm = targets(lambda x: F.gelu(x), torch.randn(4))
    [gelu] = [n for n in gm.graph.nodes if n.target is aten.gelu.default]
    assert gelu.kwargs == {"approximate": "none"}  # kwarg-only default filled in


def test_slice_bounds_are_clamped_to_the_size():
    _, gm = targets(lambda x: x[..., 4:], torch.randn(2, 8))
    [s] = [n for n in gm.graph.nodes if n.target is aten.slice.Tensor]
    assert s.args[1:4] == (-1, 4, 8)


def test_in_place_op_on_a_private_intermediate_becomes_functional():
    def fn(x):
        y = x.mean(-1, keepdim=True)
        y.add_(1e-5)
        return y.rsqrt()
    t, _ = targets(fn, torch.randn(3, 4))
    assert aten.add.Tensor in t and aten.add_.Tensor not in t and aten.add_.Scalar not in t


def test_batched_matmul_is_recomposed_whatever_the_strides():
    q = torch.randn(2, 8, 3, 4).transpose(1, 2)  # (2, 3, 8, 4), not contiguous
    k = torch.randn(2, 3, 8, 4)
    for a in (q, q.contiguous()):
        t, gm = targets(lambda a, k: a @ k.transpose(-2, -1), a, k)
        assert t == [aten.transpose.int, aten.matmul.default], t
    t, _ = targets(lambda a, b: torch.bmm(a, b), torch.randn(3, 4, 5), torch.randn(3, 5, 2))
    assert t == [aten.matmul.default]  # a batched product, however spelled


def test_matmul_shaped_einsum_is_a_matmul_and_others_are_kept():
    from fusion_compiler.canonical import einsum_as_matmul
    q, k = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8)
    for eq, a, b in (("bhqd,bhkd->bhqk", q, k), ("bhqk,bhkd->bhqd", torch.randn(2, 3, 5, 7), k),
                     ("bqhd,bkhd->bhqk", q.transpose(1, 2), k.transpose(1, 2)), ("ij,jk->ik", torch.randn(4, 5), torch.randn(5, 6)),
                     ("bij,bkj->bki", torch.randn(2, 3, 4), torch.randn(2, 5, 4))):
        torch.testing.assert_close(einsum_as_matmul(eq, a, b), torch.einsum(eq, a, b))
    assert einsum_as_matmul("ij,ij->ij", torch.randn(2, 3), torch.randn(2, 3)) is None  # no contraction
    assert einsum_as_matmul("bij,bjk,bkl->bil", q, k, q) is None  # three operands
    assert einsum_as_matmul("ii->i", torch.randn(3, 3)) is None
