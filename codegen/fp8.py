"""FP8 quantization for scaled GEMMs: one kernel reads a high-precision matrix once (twice for a
per-row scale: the row's amax, then the cast, the second read from L2) and writes the FP8 matrix,
row-major, with its dequantization scale.

    q = clamp(x * s, -MAX, MAX) in float8 (e4m3: MAX 448; e5m2: MAX 57344), s = MAX / amax,
    x ~= q / s: torch._scaled_mm takes 1 / s as the operand's scale.
Per-row scales (rowwise recipes) are the row's amax; a per-tensor scale (tensorwise) is the amax of
the whole matrix, reduced from per-row amaxes. The input is read through any strides, so a
transposed operand (w^T for dx, dy^T and x^T for dW) is quantized straight into the row-major layout
that _scaled_mm wants, without a transposed copy in high precision.
"""
import torch
import triton
import triton.language as tl

from .launch import alloc, interpreting

FP8 = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}
MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
EPS = 1e-12  # amax floor: an all-zero row gets a finite scale


# (mantissa bits, smallest normal, subnormal step) of each FP8 format
GRID = {torch.float8_e4m3fn: (3, 2.0 ** -6, 2.0 ** -9), torch.float8_e5m2: (2, 2.0 ** -14, 2.0 ** -16)}


@triton.jit
def _round_to_grid(x, MANT: tl.constexpr, MIN_NORMAL: tl.constexpr, SUB_STEP: tl.constexpr):
    """x rounded to nearest-even on the FP8 grid, in fp32 (the interpreter's own cast to FP8 drops
    the carry of a rounding into the exponent: 124.3 became 64, not 128)."""
    bits = x.to(tl.int32, bitcast=True)
    shift: tl.constexpr = 23 - MANT
    lsb = (bits >> shift) & 1
    normal = (((bits + lsb + (1 << (shift - 1)) - 1) >> shift) << shift).to(tl.float32, bitcast=True)
    magic = 1.5 * 8388608.0 * SUB_STEP  # adding and subtracting it rounds to a multiple of SUB_STEP
    return tl.where(tl.abs(x) < MIN_NORMAL, (x + magic) - magic, normal)


@triton.jit
def _row_amax(X, row_mask, rows, R_STRIDE, C, C_STRIDE, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        x = tl.load(X + rows[:, None].to(tl.int64) * R_STRIDE + cols[None, :] * C_STRIDE,
                    mask=row_mask[:, None] & (cols < C)[None, :], other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), 1))
    return amax


@triton.jit
def _amax_kernel(X, AMAX, R, C, s_r, s_c, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """AMAX[r] = max |X[r, :]|."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < R
    tl.store(AMAX + rows, _row_amax(X, row_mask, rows, s_r, C, s_c, BLOCK_R, BLOCK_C), mask=row_mask)


@triton.jit
def _quantize_kernel(X, Q, INV, AMAX, R, C, s_r, s_c,
                     PER_ROW: tl.constexpr, FP8_TYPE: tl.constexpr, FP8_MAX: tl.constexpr, EPS_: tl.constexpr,
                     ROUND: tl.constexpr, MANT: tl.constexpr, MIN_NORMAL: tl.constexpr, SUB_STEP: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Q[r, :] = clamp(X[r, :] * s) as FP8, row-major; INV[r] (per row) or INV[0] (tensorwise) = 1 / s."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < R
    if PER_ROW:
        amax = _row_amax(X, row_mask, rows, s_r, C, s_c, BLOCK_R, BLOCK_C)
    else:
        amax = tl.zeros((BLOCK_R,), dtype=tl.float32) + tl.load(AMAX)
    scale = FP8_MAX / tl.maximum(amax, EPS_)
    if PER_ROW:
        tl.store(INV + rows, 1.0 / scale, mask=row_mask)
    else:
        if tl.program_id(0) == 0:
            tl.store(INV, tl.max(1.0 / scale, 0))
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = row_mask[:, None] & (cols < C)[None, :]
        x = tl.load(X + rows[:, None].to(tl.int64) * s_r + cols[None, :] * s_c, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x * scale[:, None], -FP8_MAX), FP8_MAX)
        if ROUND:
            q = tl.minimum(tl.maximum(_round_to_grid(q, MANT, MIN_NORMAL, SUB_STEP), -FP8_MAX), FP8_MAX)
        tl.store(Q + rows[:, None].to(tl.int64) * C + cols[None, :], q.to(FP8_TYPE), mask=mask)


def _tiles(cols: int) -> tuple[int, int]:
    block_c = min(triton.next_power_of_2(max(cols, 1)), 256 if interpreting() else 1024)
    return (4 if interpreting() else 8), block_c


def quantize(x: torch.Tensor, dtype: torch.dtype, per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [R, C] row-major in `dtype`, dequantization scale [R, 1] per row or [] per tensor, fp32) of
    the 2-D x (any strides)."""
    rows, cols = x.shape
    q = alloc((rows, cols), dtype, x.device)
    inv = alloc((rows, 1) if per_row else (), torch.float32, x.device)
    block_r, block_c = _tiles(cols)
    grid = (triton.cdiv(rows, block_r),)
    amax = inv
    if not per_row:
        row_amax = alloc((rows,), torch.float32, x.device)
        if rows:
            _amax_kernel[grid](x, row_amax, rows, cols, x.stride(0), x.stride(1), BLOCK_R=block_r, BLOCK_C=block_c)
        amax = row_amax.amax() if rows else torch.zeros((), device=x.device)
    if rows:
        _quantize_kernel[grid](x, q, inv, amax, rows, cols, x.stride(0), x.stride(1), PER_ROW=per_row,
                               FP8_TYPE=FP8[dtype], FP8_MAX=MAX[dtype], EPS_=EPS, ROUND=interpreting(),
                               MANT=GRID[dtype][0], MIN_NORMAL=GRID[dtype][1], SUB_STEP=GRID[dtype][2],
                               BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4)
    return q, inv


def quantize_reference(x: torch.Tensor, dtype: torch.dtype, per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in torch ops (the emulation path and the tests' reference)."""
    xf = x.float()
    amax = xf.abs().amax(1, keepdim=True) if per_row else xf.abs().amax()
    scale = MAX[dtype] / amax.clamp(min=EPS)
    return (xf * scale).clamp(-MAX[dtype], MAX[dtype]).to(dtype), 1.0 / scale
