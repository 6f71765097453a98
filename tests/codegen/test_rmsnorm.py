import pytest
import torch

from fusion_compiler.codegen import rmsnorm
from tests.helpers import DTYPES, assert_close

SHAPES = [(1, 16), (9, 41, 341), (5, 1000), (3, 2, 4096)]


def ref_rms(x, w, eps, r=None):
    h = x + r if r is not None else x
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h * rstd * w, h, rstd.reshape(-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_forward_backward(dtype, shape, residual):
    n = shape[-1]
    x = torch.randn(shape, dtype=dtype)
    r = torch.randn(shape, dtype=dtype) if residual else None
    w = (1 + 0.2 * torch.randn(n)).to(dtype)
    y, h, rstd, _ = rmsnorm.rms_norm_fwd(x, w, 1e-6, residual=r)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    r64 = r.double() if residual else None
    y64, h64, rstd64 = ref_rms(x64, w64, 1e-6, r64)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, y64, dtype, "y")
    assert_close(rstd, rstd64, dtype, "rstd")
    if residual:
        assert h.dtype == dtype
        assert_close(h, h64, dtype, "h")
    dy = torch.randn(shape, dtype=dtype)
    dh_in = torch.randn(shape, dtype=dtype) if residual else None
    dx, dw = rmsnorm.rms_norm_bwd(dy, h if residual else x, w, rstd, dh_in)
    outs, grads = [y64], [dy.double()]
    if residual:
        outs.append(h64)
        grads.append(dh_in.double())
    dx64, dw64 = torch.autograd.grad(outs, (x64, w64), grads)
    assert dx.dtype == dtype and dw.dtype == dtype
    assert_close(dx, dx64, dtype, "dx")
    assert_close(dw, dw64, dtype, "dw", factor=2 if dtype != torch.float32 else 1)


def test_rms_norm_strided_rows():
    """A row-strided view (every other row of a buffer) is read through its stride."""
    base = torch.randn(12, 64)
    x = base[::2]
    w = torch.randn(64)
    y, _, _, _ = rmsnorm.rms_norm_fwd(x, w, 1e-5)
    assert_close(y, ref_rms(x.double(), w.double(), 1e-5)[0], torch.float32, "y")


def test_rms_norm_empty_rows():
    y, _, rstd, _ = rmsnorm.rms_norm_fwd(torch.randn(0, 32), torch.randn(32), 1e-5)
    assert y.shape == (0, 32) and rstd.shape == (0,)
