import pytest
import torch
import torch.nn.functional as F

from fusion_compiler.codegen import glu
from tests.helpers import DTYPES, assert_close

ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("shape", [(3, 7, 341), (2, 1500)])
def test_glu_forward_backward(dtype, act, shape):
    gate = (torch.randn(shape) * 2).to(dtype)
    up = torch.randn(shape, dtype=dtype)
    y = glu.glu_fwd(gate, up, act)
    g64, u64 = gate.double().requires_grad_(), up.double().requires_grad_()
    y64 = ACTS[act](g64) * u64
    assert y.dtype == dtype and y.shape == gate.shape
    assert_close(y, y64, dtype, "y")
    dy = torch.randn(shape, dtype=dtype)
    dg, du = glu.glu_bwd(dy, gate, up, act)
    dg64, du64 = torch.autograd.grad(y64, (g64, u64), dy.double())
    assert_close(dg.view(shape), dg64, dtype, "dgate")
    assert_close(du.view(shape), du64, dtype, "dup")


@pytest.mark.parametrize("dtype", DTYPES)
def test_glu_row_scale(dtype):
    """y = row_scale[r] * act(gate) * up, rounded once (the MoE's routing weight on each sorted row)."""
    gate, up, scale = torch.randn(37, 129).to(dtype), torch.randn(37, 129).to(dtype), torch.rand(37)
    y = glu.glu_fwd(gate, up, "silu", row_scale=scale)
    assert_close(y, F.silu(gate.double()) * up.double() * scale.double()[:, None], dtype, "y")


def test_glu_reads_halves_of_a_packed_buffer_in_place():
    x = torch.randn(5, 9, 2 * 77)
    gate, up = x.chunk(2, -1)
    y = glu.glu_fwd(gate, up, "silu")
    assert_close(y, F.silu(gate.double()) * up.double(), torch.float32, "y")
