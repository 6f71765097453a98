"""The interpreter's float32 -> bfloat16 cast rounds to nearest even, as the GPU does (tests/interpreter.py)."""
import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

from tests.interpreter import round_bf16_like_gpu


@triton.jit
def _cast_kernel(X, Y, Z, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(X + offs)
    tl.store(Y + offs, x.to(tl.bfloat16))  # an explicit cast
    tl.store(Z + offs, x * 1.0)  # the store's implicit cast to the pointer's type


def test_the_patched_method_is_still_there():
    assert hasattr(interpreter, "InterpreterBuilder") and hasattr(interpreter, "TensorHandle"), \
        "triton.runtime.interpreter moved: see tests/interpreter.py"
    assert getattr(interpreter.InterpreterBuilder.cast_impl, "rounds_bf16", False), \
        "conftest.py did not install the rounding cast"
    patched = interpreter.InterpreterBuilder.cast_impl
    round_bf16_like_gpu()  # a second call keeps the one patch (no wrapper around the wrapper)
    assert interpreter.InterpreterBuilder.cast_impl is patched


def test_float32_to_bfloat16_rounds_bit_for_bit_like_torch():
    bf16_ulp = 2.0 ** -7
    specials = torch.tensor([1.0 + bf16_ulp / 2, 1.0 + 1.5 * bf16_ulp, -(1.0 + bf16_ulp / 2), 3.3895e38,
                             float("inf"), float("-inf"), 1e-40, -0.0, 0.0, float("nan")])  # ties, overflow, subnormal
    x = torch.cat([torch.randn(1014) * 10.0 ** torch.randint(-30, 30, (1014,)), specials])
    y, z = (torch.empty(1024, dtype=torch.bfloat16) for _ in range(2))
    _cast_kernel[(1,)](x, y, z, N=1024)
    expected = x.to(torch.bfloat16).view(torch.int16)
    for got in (y, z):
        bits = got.view(torch.int16)
        same = (bits == expected) | (got.isnan() & x.isnan())
        assert bool(same.all()), f"{int((~same).sum())} casts differ, e.g. {x[~same][:3].tolist()}"
    assert np.uint16(y.view(torch.int16)[1014].item() & 0xFFFF) == 0x3F80  # the tie to even: down to 1.0
