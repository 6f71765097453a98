import pytest
import torch
import torch.nn.functional as F

from fusion_compiler.codegen import layernorm
from tests.helpers import DTYPES, assert_close


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 16), (9, 41, 341), (7, 2048)])
@pytest.mark.parametrize("affine", ["both", "weight", "none"])
def test_layer_norm_forward_backward(dtype, shape, affine):
    n = shape[-1]
    x = (torch.randn(shape) * 3 + 1.5).to(dtype)
    w = (1 + 0.2 * torch.randn(n)).to(dtype) if affine != "none" else None
    b = (0.3 * torch.randn(n)).to(dtype) if affine == "both" else None
    y, mean, rstd = layernorm.layer_norm_fwd(x, w, b, 1e-5)
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_() if w is not None else None
    b64 = b.double().requires_grad_() if b is not None else None
    y64 = F.layer_norm(x64, (n,), w64, b64, 1e-5)
    assert y.dtype == dtype
    assert_close(y, y64, dtype, "y")
    assert_close(mean, x64.mean(-1).reshape(-1), dtype, "mean")
    dy = torch.randn(shape, dtype=dtype)
    dx, dw, db = layernorm.layer_norm_bwd(dy, x, w, mean, rstd)
    inputs = [t for t in (x64, w64, b64) if t is not None]
    grads = torch.autograd.grad(y64, inputs, dy.double())
    assert_close(dx, grads[0], dtype, "dx")
    if w is not None:
        assert_close(dw, grads[1], dtype, "dw", factor=2)
    if b is not None:
        assert_close(db, grads[2], dtype, "db", factor=2)
