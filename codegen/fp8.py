"""FP8 quantization for scaled GEMMs: a high-precision matrix becomes an FP8 matrix, row-major, with
its dequantization scale.

    q = clamp(x * s, -MAX, MAX) in float8 (e4m3: MAX 448; e5m2: MAX 57344), s = MAX / amax,
    x ~= q / s: torch._scaled_mm takes 1 / s as the operand's scale.
Per-row scales (rowwise recipes, `quantize`), by layout:
- rows contiguous (x, w, dy of the forward and dx): a row of up to ROW_MAX elements is read once,
  its amax taken in registers and the row cast (one read, one write); longer rows take an amax pass
  first.
- rows strided, columns contiguous (the backward's w^T, dy^T, x^T: a transposed view): an amax pass
  over 2-D tiles read along the contiguous dimension (partial maxima combined with atomics, so the
  grid covers the whole matrix), then the cast over the same tiles, written transposed into the
  row-major layout _scaled_mm wants; no transposed copy in high precision.
A per-tensor scale (tensorwise, `quantize_tensorwise`) is the same for a matrix and its transpose, so
one cast pass writes both layouts (q and q^T, each row-major) after an amax pass: x, w and dy are each
read twice and written twice in FP8, and the backward re-reads none of them in high precision.
`quantize_rows_tile` is the per-row step for other kernels that hold whole rows (codegen/rmsnorm.py:
the norm writes its output's FP8 copy in the same pass).
"""
import functools

import torch
import triton
import triton.language as tl

from .launch import alloc, cdiv, fast_launch, interpreting, next_pow2

FP8 = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}
MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
EPS = 1e-12  # amax floor: an all-zero row gets a finite scale
# (mantissa bits, smallest normal, subnormal step) of each FP8 format
GRID = {torch.float8_e4m3fn: (3, 2.0 ** -6, 2.0 ** -9), torch.float8_e5m2: (2, 2.0 ** -14, 2.0 ** -16)}
ROW_MAX = 16384  # widest row cast from registers after one read


def cast_args(dtype: torch.dtype) -> dict:
    """The constexpr arguments of the cast to `dtype` for the kernels that call `cast` (one shared
    dict a dtype: unpack it, do not change it)."""
    return _cast_args(dtype, interpreting())


@functools.lru_cache(maxsize=None)
def _cast_args(dtype: torch.dtype, interpreter: bool) -> dict:
    return dict(FP8_TYPE=FP8[dtype], FP8_MAX=MAX[dtype], ROUND=interpreter, MANT=GRID[dtype][0],
                MIN_NORMAL=GRID[dtype][1], SUB_STEP=GRID[dtype][2])


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
def scale_of(amax, FP8_MAX: tl.constexpr):
    """s = MAX / amax (amax floored at EPS), in fp32 (the interpreter would keep fp64)."""
    return (FP8_MAX / tl.maximum(amax, 1e-12)).to(tl.float32)


@triton.jit
def cast(x, scale, FP8_TYPE: tl.constexpr, FP8_MAX: tl.constexpr, ROUND: tl.constexpr, MANT: tl.constexpr,
         MIN_NORMAL: tl.constexpr, SUB_STEP: tl.constexpr):
    """x * scale (fp32, broadcast) clamped to the format's range, in FP8."""
    q = tl.minimum(tl.maximum(x * scale, -FP8_MAX), FP8_MAX)
    if ROUND:
        q = tl.minimum(tl.maximum(_round_to_grid(q, MANT, MIN_NORMAL, SUB_STEP), -FP8_MAX), FP8_MAX)
    return q.to(FP8_TYPE)


@triton.jit
def quantize_rows_tile(x, FP8_TYPE: tl.constexpr, FP8_MAX: tl.constexpr, ROUND: tl.constexpr, MANT: tl.constexpr,
                       MIN_NORMAL: tl.constexpr, SUB_STEP: tl.constexpr):
    """(q, inv) of a tile of whole rows in fp32 (masked entries 0): FP8 values and each row's
    dequantization scale 1 / s."""
    scale = scale_of(tl.max(tl.abs(x), 1), FP8_MAX)
    return cast(x, scale[:, None], FP8_TYPE, FP8_MAX, ROUND, MANT, MIN_NORMAL, SUB_STEP), 1.0 / scale


@fast_launch
@triton.jit
def _row_amax_kernel(X, AMAX, R, C, s_r, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """AMAX[r] = max |X[r, :]|, rows contiguous."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < R
    amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        x = tl.load(X + rows[:, None].to(tl.int64) * s_r + cols[None, :],
                    mask=row_mask[:, None] & (cols < C)[None, :], other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), 1))
    tl.store(AMAX + rows, amax, mask=row_mask)


@fast_launch
@triton.jit
def _quantize_rows_kernel(X, Q, INV, AMAX, R, C, s_r, ONE_TILE: tl.constexpr,
                          FP8_TYPE: tl.constexpr, FP8_MAX: tl.constexpr, ROUND: tl.constexpr, MANT: tl.constexpr,
                          MIN_NORMAL: tl.constexpr, SUB_STEP: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Rows contiguous, a scale per row. ONE_TILE: the row's amax from the one read (AMAX unused);
    else from AMAX[r]."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < R
    base = X + rows[:, None].to(tl.int64) * s_r
    out = Q + rows[:, None].to(tl.int64) * C
    if ONE_TILE:
        cols = tl.arange(0, BLOCK_C)
        mask = row_mask[:, None] & (cols < C)[None, :]
        x = tl.load(base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        q, inv = quantize_rows_tile(x, FP8_TYPE, FP8_MAX, ROUND, MANT, MIN_NORMAL, SUB_STEP)
        tl.store(out + cols[None, :], q, mask=mask)
        tl.store(INV + rows, inv, mask=row_mask)
    else:
        scale = scale_of(tl.load(AMAX + rows, mask=row_mask, other=0.0), FP8_MAX)
        tl.store(INV + rows, 1.0 / scale, mask=row_mask)
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            mask = row_mask[:, None] & (cols < C)[None, :]
            x = tl.load(base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(out + cols[None, :], cast(x, scale[:, None], FP8_TYPE, FP8_MAX, ROUND, MANT, MIN_NORMAL, SUB_STEP),
                     mask=mask)


@fast_launch
@triton.jit
def _strided_amax_kernel(X, AMAX, R, C, s_c, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, CHUNK: tl.constexpr):
    """AMAX[r] = max(AMAX[r], max |X[r, c]| over this program's CHUNK columns); X[r, c] at r + c * s_c.
    AMAX starts at 0 (amaxes are >= 0, so the atomic maximum over fp32 is exact)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < R
    amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c0 in range(tl.program_id(1) * CHUNK, tl.minimum(C, (tl.program_id(1) + 1) * CHUNK), BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        x = tl.load(X + rows[:, None] + cols[None, :].to(tl.int64) * s_c,
                    mask=row_mask[:, None] & (cols < C)[None, :], other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), 1))
    tl.atomic_max(AMAX + rows, amax, mask=row_mask)


@fast_launch
@triton.jit
def _quantize_strided_kernel(X, Q, INV, AMAX, R, C, s_c,
                             FP8_TYPE: tl.constexpr, FP8_MAX: tl.constexpr, ROUND: tl.constexpr, MANT: tl.constexpr,
                             MIN_NORMAL: tl.constexpr, SUB_STEP: tl.constexpr,
                             BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """One BLOCK_R x BLOCK_C tile of Q = cast(X) (X[r, c] at r + c * s_c, Q row-major), scales from AMAX."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_mask = rows < R
    mask = row_mask[:, None] & (cols < C)[None, :]
    scale = scale_of(tl.load(AMAX + rows, mask=row_mask, other=0.0), FP8_MAX)
    if tl.program_id(1) == 0:
        tl.store(INV + rows, 1.0 / scale, mask=row_mask)
    x = tl.load(X + rows[:, None] + cols[None, :].to(tl.int64) * s_c, mask=mask, other=0.0).to(tl.float32)
    q = cast(x, scale[:, None], FP8_TYPE, FP8_MAX, ROUND, MANT, MIN_NORMAL, SUB_STEP)
    tl.store(Q + rows[:, None].to(tl.int64) * C + cols[None, :], q, mask=mask)


@fast_launch
@triton.jit
def _amax_partial_kernel(X, PARTIAL, R, C, s_r, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """PARTIAL[p] = max |X| over row blocks p, p + P, p + 2P, ... (P programs); rows contiguous."""
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for r0 in range(pid * BLOCK_R, R, tl.num_programs(0) * BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        base = X + rows[:, None].to(tl.int64) * s_r
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            x = tl.load(base + cols[None, :], mask=(rows < R)[:, None] & (cols < C)[None, :], other=0.0)
            acc = tl.maximum(acc, tl.abs(x.to(tl.float32)))
    tl.store(PARTIAL + pid, tl.max(tl.max(acc, 1), 0))


@fast_launch
@triton.jit
def _cast_both_kernel(X, Q, QT, INV, PARTIAL, n_partial, R, C, s_r, WRITE_Q: tl.constexpr, WRITE_QT: tl.constexpr,
                      FP8_TYPE: tl.constexpr, FP8_MAX: tl.constexpr, ROUND: tl.constexpr, MANT: tl.constexpr,
                      MIN_NORMAL: tl.constexpr, SUB_STEP: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
    """One BLOCK_R x BLOCK_C tile of X (rows contiguous) cast with the scale of max(PARTIAL), stored
    at Q[r, c] and at QT[c, r] (both row-major); INV = the dequantization scale."""
    p = tl.arange(0, BLOCK_P)
    scale = scale_of(tl.max(tl.load(PARTIAL + p, mask=p < n_partial, other=0.0), 0), FP8_MAX)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(INV, 1.0 / scale)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    x = tl.load(X + rows[:, None].to(tl.int64) * s_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    q = cast(x, scale, FP8_TYPE, FP8_MAX, ROUND, MANT, MIN_NORMAL, SUB_STEP)
    if WRITE_Q:
        tl.store(Q + rows[:, None].to(tl.int64) * C + cols[None, :], q, mask=mask)
    if WRITE_QT:
        tl.store(QT + cols[None, :].to(tl.int64) * R + rows[:, None], q, mask=mask)


# the strided layout's tiles: (BLOCK_R along the contiguous dimension, BLOCK_C, amax CHUNK, warps);
# the best on the H200 for every operand of the reference Llama step (benchmarks/tune_fp8_quantize.py)
STRIDED_TILES = (64, 128, 256, 4)


def quantize_strided(x, q, inv, dtype: torch.dtype, tiles=None) -> None:
    """q, inv <- the per-row cast of x [R, C] whose rows are strided and columns contiguous
    (x.stride(0) == 1)."""
    rows, cols = x.shape
    block_r, block_c, chunk, warps = (32, 64, 64, 4) if interpreting() else (tiles or STRIDED_TILES)
    amax = torch.zeros((rows,), dtype=torch.float32, device=x.device)
    _strided_amax_kernel[(cdiv(rows, block_r), cdiv(cols, chunk))](
        x, amax, rows, cols, x.stride(1), BLOCK_R=block_r, BLOCK_C=block_c, CHUNK=chunk, num_warps=warps)
    _quantize_strided_kernel[(cdiv(rows, block_r), cdiv(cols, block_c))](
        x, q, inv, amax, rows, cols, x.stride(1), **cast_args(dtype), BLOCK_R=block_r, BLOCK_C=block_c,
        num_warps=warps)


def _row_tiles(cols: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, num_warps): whole rows up to ROW_MAX elements, ~8K elements a program."""
    block_c = next_pow2(max(cols, 1))
    if interpreting():
        return 16, min(block_c, 256), 4
    if block_c > ROW_MAX:
        return 4, 1024, 8
    return max(1, 8192 // block_c), block_c, (8 if block_c >= 4096 else 4)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [R, C] row-major in `dtype`, dequantization scale [R, 1] per row, fp32) of the 2-D x (any
    strides)."""
    rows, cols = x.shape
    q = alloc((rows, cols), dtype, x.device)
    inv = alloc((rows, 1), torch.float32, x.device)
    if rows == 0 or cols == 0:
        inv.fill_(EPS / MAX[dtype])
        return q, inv
    if x.stride(1) != 1 and x.stride(0) == 1:
        quantize_strided(x, q, inv, dtype)
        return q, inv
    if x.stride(1) != 1:
        x = x.contiguous()
    block_r, block_c, warps = _row_tiles(cols)
    grid = (cdiv(rows, block_r),)
    one_tile = block_c >= cols
    amax = inv
    if not one_tile:
        amax = alloc((rows,), torch.float32, x.device)
        _row_amax_kernel[grid](x, amax, rows, cols, x.stride(0), BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    _quantize_rows_kernel[grid](x, q, inv, amax, rows, cols, x.stride(0), ONE_TILE=one_tile,
                                **cast_args(dtype), BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return q, inv


def quantize_reference(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in torch ops (the emulation path, the tests' reference, and the cast patterns/fp8.py
    hands Inductor to fuse into the kernel making x): s = MAX / amax divided as the kernels divide."""
    xf = x.float()
    amax = xf.abs().amax(1, keepdim=True).clamp(min=EPS)
    scale = torch.full_like(amax, MAX[dtype]) / amax
    return (xf * scale).clamp(-MAX[dtype], MAX[dtype]).to(dtype), 1.0 / scale


# per-tensor scales: (BLOCK_R, BLOCK_C, warps) of the cast tiles; the amax pass's program count cap
TENSOR_TILES = (128, 128, 8)
AMAX_PROGRAMS = 1024


def amax_partials(x: torch.Tensor) -> torch.Tensor:
    """Partial maxima of |x| (2-D, rows contiguous, not empty), one per program of the amax pass
    (up to AMAX_PROGRAMS): the cast kernels take the maximum of these as the tensor's amax."""
    n_rows, n_cols = x.shape
    block_c = min(next_pow2(n_cols), 256 if interpreting() else 1024)
    block_r = max(1, (4096 if interpreting() else 8192) // block_c)
    programs = min(cdiv(n_rows, block_r), 16 if interpreting() else AMAX_PROGRAMS)
    partial = alloc((programs,), torch.float32, x.device)
    _amax_partial_kernel[(programs,)](x, partial, n_rows, n_cols, x.stride(0), BLOCK_R=block_r, BLOCK_C=block_c,
                                      num_warps=8 if block_r * block_c >= 8192 else 4)
    return partial


def cast_tiles() -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, warps) of the tensorwise cast's tiles (TENSOR_TILES on a GPU)."""
    return (32, 64, 4) if interpreting() else TENSOR_TILES


def tensorwise_outputs(n_rows: int, n_cols: int, dtype: torch.dtype, device, rows: bool, transposed: bool) -> tuple:
    """(q [R, C] or None, q^T [C, R] or None, scale []) to be written by a tensorwise cast; the scale of
    an empty matrix already set (finite)."""
    q = alloc((n_rows, n_cols), dtype, device) if rows else None
    qt = alloc((n_cols, n_rows), dtype, device) if transposed else None
    inv = alloc((), torch.float32, device)
    if n_rows == 0 or n_cols == 0:
        inv.fill_(EPS / MAX[dtype])
    return q, qt, inv


def quantize_tensorwise(x: torch.Tensor, dtype: torch.dtype, rows: bool = True,
                        transposed: bool = True) -> tuple:
    """(q [R, C] or None, q^T [C, R] or None, dequantization scale [] fp32) of the 2-D x with one
    scale for the whole matrix: an amax pass, then one cast pass writing the layouts asked for
    (q^T row-major is the transpose's own cast: the same scale, the same rounding)."""
    n_rows, n_cols = x.shape
    q, qt, inv = tensorwise_outputs(n_rows, n_cols, dtype, x.device, rows, transposed)
    if n_rows == 0 or n_cols == 0:
        return q, qt, inv
    if x.stride(1) != 1:
        x = x.contiguous()
    partial = amax_partials(x)
    programs = partial.numel()
    tile_r, tile_c, warps = cast_tiles()
    out = q if q is not None else qt
    _cast_both_kernel[(cdiv(n_rows, tile_r), cdiv(n_cols, tile_c))](
        x, out, qt if qt is not None else out, inv, partial, programs, n_rows, n_cols, x.stride(0),
        WRITE_Q=rows, WRITE_QT=transposed, **cast_args(dtype), BLOCK_R=tile_r, BLOCK_C=tile_c,
        BLOCK_P=next_pow2(programs), num_warps=warps)
    return q, qt, inv


def quantize_tensorwise_reference(x: torch.Tensor, dtype: torch.dtype, rows: bool = True,
                                  transposed: bool = True) -> tuple:
    """The same in torch ops."""
    xf = x.float()
    scale = MAX[dtype] / xf.abs().amax().clamp(min=EPS)
    q = (xf * scale).clamp(-MAX[dtype], MAX[dtype]).to(dtype)
    return q if rows else None, q.t().contiguous() if transposed else None, 1.0 / scale
