"""Triton's CPU interpreter made to round like the GPU.

Triton 3.6's interpreter casts float32 to bfloat16 by dropping the low 16 bits (round toward zero,
`InterpreterBuilder.cast_impl`); the GPU's `cvt.rn.bf16.f32` rounds to nearest even. Truncation is
biased (every cast loses ~2^-9 relative toward zero), so errors add up along a chain of casts instead
of averaging out and a bf16 test would measure the interpreter rather than the kernel. conftest.py
applies `round_bf16_like_gpu()` before any test runs; tests/test_interpreter.py checks the cast bit for
bit against torch and fails loudly when the patched method moves.
"""
import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter


def _to_bf16_bits(data: np.ndarray) -> np.ndarray:
    """float32 values -> bfloat16 bit patterns (uint16), rounded to nearest even (torch's cast)."""
    values = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
    return values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).reshape(data.shape)


def round_bf16_like_gpu() -> None:
    builder = interpreter.InterpreterBuilder
    truncating = builder.cast_impl
    if getattr(truncating, "rounds_bf16", False):
        return

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(_to_bf16_bits(src.data), dst_type.scalar)
        return truncating(self, src, dst_type)

    cast_impl.rounds_bf16 = True
    builder.cast_impl = cast_impl
