"""RMSNorm, optionally preceded by a residual add, forward and backward.

    h    = x + r                      (only with a residual; written out, rounded to x's dtype)
    rstd = 1 / sqrt(mean(h^2) + eps)  (fp32, one per row, saved for the backward)
    y    = h * rstd * w

Backward, with xhat = h * rstd and g = dy * w:
    dh = rstd * (g - xhat * mean(g * xhat)) (+ the gradient that reached h directly)
    dw = sum over rows of dy * xhat       (per-program partial sums, then one small reduction)
All arithmetic is fp32: inputs are loaded, then upcast at once.
With an FP8 dtype the forward also writes y's FP8 copy with a scale per row (codegen/fp8.py; y as
stored, rounded to its dtype, so the copy equals quantizing y afterwards): the input of an FP8 linear,
cast in the pass that produces it.
"""
import torch
import triton
import triton.language as tl

from . import fp8
from .launch import alloc, as_rows, bwd_row_tile, cdiv, fast_launch, persistent_programs, row_tile


@fast_launch
@triton.jit
def _rms_norm_fwd_kernel(
    # pointers
    X, R, W, Y, H, RSTD, Q, INV,
    # sizes
    M, N,
    # row strides
    stride_x, stride_r, stride_y, stride_h,
    eps,
    # meta-parameters
    HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    # the FP8 copy of y (QUANT), codegen/fp8.cast_args
    QUANT: tl.constexpr, FP8_TYPE: tl.constexpr, FP8_MAX: tl.constexpr, ROUND: tl.constexpr, MANT: tl.constexpr,
    MIN_NORMAL: tl.constexpr, SUB_STEP: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    mask = row_mask[:, None] & (cols < N)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        h = (x + r).to(H.dtype.element_ty)
        tl.store(H + rows[:, None] * stride_h + cols[None, :], h, mask=mask)
        x = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = (x * rstd[:, None] * w[None, :]).to(Y.dtype.element_ty)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y, mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)
    if QUANT:
        q, inv = fp8.quantize_rows_tile(y.to(tl.float32), FP8_TYPE, FP8_MAX, ROUND, MANT, MIN_NORMAL, SUB_STEP)
        tl.store(Q + rows[:, None].to(tl.int64) * N + cols[None, :], q, mask=mask)
        tl.store(INV + rows, inv, mask=row_mask)


@fast_launch
@triton.jit
def _rms_norm_bwd_kernel(
    # pointers
    DY, H, W, RSTD, DH_IN, DX, DW_PARTIAL,
    # sizes
    M, N,
    # row strides
    stride_dy, stride_h, stride_dhin, stride_dx,
    # meta-parameters
    HAS_DH_IN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    for block in range(pid, tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        h = tl.load(H + rows[:, None] * stride_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        xhat = h * rstd[:, None]
        g = dy * w[None, :]
        c = tl.sum(g * xhat, axis=1) / N
        dx = (g - xhat * c[:, None]) * rstd[:, None]
        if HAS_DH_IN:
            dx += tl.load(DH_IN + rows[:, None] * stride_dhin + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * xhat, axis=0)
    tl.store(DW_PARTIAL + pid * N + cols, dw, mask=col_mask)


def rms_norm_fwd(x, weight, eps, residual=None, fp8_dtype=None):
    """Returns (y, h, rstd, q); h is None without a residual. y has dtype promote(x, weight). q: None, or
    with an fp8_dtype (q [rows, N] row-major, its dequantization scale [rows, 1] fp32) of y."""
    n = x.shape[-1]
    x2 = as_rows(x)
    m = x2.shape[0]
    y = alloc((m, n), torch.promote_types(x.dtype, weight.dtype), x.device)
    rstd = alloc((m,), torch.float32, x.device)
    r2 = h = None
    if residual is not None:
        r2 = as_rows(residual)
        h = alloc((m, n), x.dtype, x.device)
    q = inv = None
    if fp8_dtype is not None:
        q, inv = alloc((m, n), fp8_dtype, x.device), alloc((m, 1), torch.float32, x.device)
    block_m, block_n, warps = row_tile(n)
    if m > 0:
        _rms_norm_fwd_kernel[(cdiv(m, block_m),)](
            x2, r2 if r2 is not None else x2, weight.contiguous(), y, h if h is not None else y, rstd,
            q if q is not None else y, inv if inv is not None else rstd,
            m, n,
            x2.stride(0), r2.stride(0) if r2 is not None else 0, y.stride(0), h.stride(0) if h is not None else 0,
            eps,
            HAS_RESIDUAL=residual is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
            QUANT=fp8_dtype is not None, **fp8.cast_args(fp8_dtype or torch.float8_e4m3fn),
        )
    y = y.view(x.shape)
    return y, (h.view(x.shape) if h is not None else None), rstd, (None if q is None else (q, inv))


def rms_norm_bwd(dy, h, weight, rstd, dh_in=None):
    """Returns (dh, dweight); dh has h's dtype and includes dh_in when given."""
    n = h.shape[-1]
    dy2, h2 = as_rows(dy), as_rows(h)
    m = h2.shape[0]
    dh2 = as_rows(dh_in) if dh_in is not None else None
    dx = alloc((m, n), h.dtype, h.device)
    block_m, block_n, warps, per_sm = bwd_row_tile(n)
    progs = persistent_programs(cdiv(m, block_m), h.device, per_sm)
    dw_partial = torch.zeros((progs, n), dtype=torch.float32, device=h.device)
    if m > 0:
        _rms_norm_bwd_kernel[(progs,)](
            dy2, h2, weight.contiguous(), rstd, dh2 if dh2 is not None else dy2, dx, dw_partial,
            m, n,
            dy2.stride(0), h2.stride(0), dh2.stride(0) if dh2 is not None else 0, dx.stride(0),
            HAS_DH_IN=dh_in is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
        )
    return dx.view(h.shape), dw_partial.sum(0).to(weight.dtype)
