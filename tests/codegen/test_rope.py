import pytest
import torch

from fusion_compiler.codegen.rope import rope, rope_check
from tests.helpers import DTYPES, assert_close


def ref_half(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def ref_interleaved(x, cos, sin):
    xa, xb = x[..., 0::2], x[..., 1::2]
    return torch.stack((xa * cos - xb * sin, xa * sin + xb * cos), -1).flatten(-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_forward_backward(dtype, interleaved):
    b, h, s, d = 2, 3, 37, 24  # 12 pairs: not a power of two
    x = torch.randn(b, s, h, d, dtype=dtype).transpose(1, 2)  # (B, H, S, D), strided like HF q
    dc = d // 2 if interleaved else d
    theta = torch.randn(b, 1, s, dc)
    cos, sin = theta.cos().to(dtype), theta.sin().to(dtype)
    ref = ref_interleaved if interleaved else ref_half
    y = rope(x, cos, sin, interleaved)
    assert y.stride() == x.stride()
    x64 = x.double().requires_grad_()
    y64 = ref(x64, cos.double(), sin.double())
    assert_close(y, y64, dtype, "y")
    dy = torch.randn(y.shape, dtype=dtype)
    dx = rope(dy, cos, sin, interleaved, backward=True)
    (dx64,) = torch.autograd.grad(y64, x64, dy.double())
    assert_close(dx, dx64, dtype, "dx")


def test_rope_broadcast_over_batch_and_3d():
    x = torch.randn(5, 7, 16)  # (S, H, D): cos broadcast over H
    theta = torch.randn(5, 1, 16)
    y = rope(x, theta.cos(), theta.sin(), False)
    assert_close(y, ref_half(x.double(), theta.cos().double(), theta.sin().double()), torch.float32, "y")


def test_rope_check_reasons():
    x = torch.randn(2, 3, 4, 8)
    assert rope_check(x, torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8), False) is None
    assert "odd rotary dim" in rope_check(torch.randn(2, 7), torch.randn(7), torch.randn(7), False)
    assert "expected 4" in rope_check(x, torch.randn(4, 8), torch.randn(4, 8), True)
    assert "would broadcast x" in rope_check(x[:1], torch.randn(2, 1, 4, 8), torch.randn(2, 1, 4, 8), False)
    assert "not contiguous" in rope_check(torch.randn(2, 8, 4).transpose(1, 2), torch.randn(4), torch.randn(4), False)


def test_rope_backward_of_an_expanded_gradient():
    """The gradient of out.sum() arrives expanded (all strides 0); it must not be read as contiguous."""
    theta = torch.randn(1, 1, 5, 8)
    dy = torch.ones(()).expand(2, 3, 5, 8)
    dx = rope(dy, theta.cos(), theta.sin(), False, backward=True)
    x64 = torch.zeros(2, 3, 5, 8, dtype=torch.float64, requires_grad=True)
    (ref,) = torch.autograd.grad(ref_half(x64, theta.cos().double(), theta.sin().double()), x64, dy.double())
    assert_close(dx, ref, torch.float32, "dx")


def test_output_layouts_do_not_depend_on_a_gradients_layout():
    """Forward: laid out like x, even when x's last dim is strided (staged through a buffer).
    Backward: contiguous whatever dy's layout (the fake kernel promises contiguous)."""
    theta = torch.randn(1, 1, 5, 8)
    x = torch.randn(2, 3, 8, 5).transpose(-1, -2)  # dense, last-dim stride 5
    y = rope(x, theta.cos(), theta.sin(), False)
    assert y.stride() == torch.empty_like(x).stride()
    assert_close(y, ref_half(x.double(), theta.cos().double(), theta.sin().double()), torch.float32, "y")
    dy = torch.randn(2, 5, 3, 8).transpose(1, 2)  # the order Inductor handed over in the bug
    dx = rope(dy, theta.cos(), theta.sin(), False, backward=True)
    assert dx.is_contiguous()
