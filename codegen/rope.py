"""Rotary position embedding applied to one tensor (q or k), forward and backward.

Pairs (a, b) of the last dimension rotate by angle theta:
    half-split ("rotate_half", HF):   a = i, b = i + D/2,  cos/sin have D entries
    interleaved (complex, Meta):      a = 2i, b = 2i + 1,  cos/sin have D/2 entries
    y_a = x_a * cos_a - x_b * sin_a
    y_b = x_b * cos_b + x_a * sin_b
The backward is the same rotation with sin_a' = -sin_b and sin_b' = -sin_a (the transpose).
x has any strides (a non-unit last-dim stride is copied first); cos/sin broadcast by zero strides;
the output is laid out like x.
"""
import torch
import triton
import triton.language as tl

from . import launch
from .launch import alloc, cdiv, fast_launch, interpreting, next_pow2


@fast_launch
@triton.jit
def _rope_kernel(
    # pointers
    X, COS, SIN, Y,
    # sizes
    R, D1, D2, HALF,
    # strides of dims 0..2 (the last dim has unit stride)
    sx0, sx1, sx2, sc0, sc1, sc2, ss0, ss1, ss2, sy0, sy1, sy2,
    # meta-parameters
    INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    i0 = rows // (D1 * D2)
    i1 = (rows // D2) % D1
    i2 = rows % D2
    p = tl.arange(0, BLOCK_P)
    mask = (rows < R)[:, None] & (p < HALF)[None, :]
    if INTERLEAVED:
        a = 2 * p
        b = 2 * p + 1
        ca = p
        cb = p
    else:
        a = p
        b = p + HALF
        ca = p
        cb = p + HALF
    xo = (i0 * sx0 + i1 * sx1 + i2 * sx2)[:, None]
    co = (i0 * sc0 + i1 * sc1 + i2 * sc2)[:, None]
    so = (i0 * ss0 + i1 * ss1 + i2 * ss2)[:, None]
    yo = (i0 * sy0 + i1 * sy1 + i2 * sy2)[:, None]
    xa = tl.load(X + xo + a[None, :], mask=mask, other=0.0).to(tl.float32)
    xb = tl.load(X + xo + b[None, :], mask=mask, other=0.0).to(tl.float32)
    cos_a = tl.load(COS + co + ca[None, :], mask=mask, other=0.0).to(tl.float32)
    cos_b = tl.load(COS + co + cb[None, :], mask=mask, other=0.0).to(tl.float32)
    sin_a = tl.load(SIN + so + ca[None, :], mask=mask, other=0.0).to(tl.float32)
    sin_b = tl.load(SIN + so + cb[None, :], mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        sin_a, sin_b = -sin_b, -sin_a
    ya = xa * cos_a - xb * sin_a
    yb = xb * cos_b + xa * sin_b
    tl.store(Y + yo + a[None, :], ya.to(Y.dtype.element_ty), mask=mask)
    tl.store(Y + yo + b[None, :], yb.to(Y.dtype.element_ty), mask=mask)


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    while t.dim() < 4:
        t = t.unsqueeze(0)
    return t


def rope_check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> str | None:
    """None when the kernel handles these operands, else why not."""
    if not 2 <= x.dim() <= 4:
        return f"rank {x.dim()} (2-D to 4-D supported)"
    if x.shape[-1] % 2:
        return f"odd rotary dim {x.shape[-1]}"
    if x.stride(-1) != 1:
        return "last dim of x is not contiguous"
    want = x.shape[-1] // 2 if interleaved else x.shape[-1]
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape[-1] != want:
            return f"{name} has {t.shape[-1]} entries in its last dim, expected {want}"
        try:
            torch.broadcast_shapes(t.shape[:-1], x.shape[:-1])
        except RuntimeError:
            return f"{name} of shape {tuple(t.shape)} does not broadcast to {tuple(x.shape)}"
        if torch.broadcast_shapes(t.shape[:-1], x.shape[:-1]) != x.shape[:-1]:
            return f"{name} of shape {tuple(t.shape)} would broadcast x"
    return None


def rope(x, cos, sin, interleaved: bool, backward: bool = False):
    """Rotate x (or, with backward=True, rotate a gradient back).

    Forward: the output is laid out like x (empty_like), as eager's x * cos + ... is: the traced graph
    downstream relies on the layout of the region it replaces. Backward: the gradient is contiguous
    whatever dy's layout (autograd may hand over a layout other than the traced one, and the fake
    kernel must predict the real one).
    """
    y = alloc(x.shape, x.dtype, x.device) if backward else torch.empty_like(x)
    if launch.POISON and not backward:  # alloc poisons the backward's buffer itself
        y.fill_(float("nan"))
    if x.stride(-1) != 1:  # e.g. an expanded gradient: the kernel walks the last dim with unit stride
        x = x.contiguous()
    out = y if y.stride(-1) == 1 else torch.empty(y.shape, dtype=y.dtype, device=y.device)
    lead = x.shape[:-1]
    cos = (cos if cos.stride(-1) == 1 else cos.contiguous()).expand(*lead, cos.shape[-1])
    sin = (sin if sin.stride(-1) == 1 else sin.contiguous()).expand(*lead, sin.shape[-1])
    x4, c4, s4, o4 = (_as_4d(t) for t in (x, cos, sin, out))
    rows = x4.shape[0] * x4.shape[1] * x4.shape[2]
    half = x.shape[-1] // 2
    block_p = next_pow2(half)
    block_r = max(1, (8192 if interpreting() else 2048) // block_p)
    if rows > 0:
        _rope_kernel[(cdiv(rows, block_r),)](
            x4, c4, s4, o4,
            rows, x4.shape[1], x4.shape[2], half,
            *x4.stride()[:3], *c4.stride()[:3], *s4.stride()[:3], *o4.stride()[:3],
            INTERLEAVED=interleaved, BACKWARD=backward, BLOCK_R=block_r, BLOCK_P=block_p, num_warps=4,
        )
    if out is not y:
        y.copy_(out)
    return y
