"""LayerNorm over the last dimension, forward and backward, optional weight and bias.

    mean = sum(x) / N;  rstd = 1 / sqrt(sum((x - mean)^2) / N + eps)    (fp32, saved per row)
    y    = (x - mean) * rstd * w + b

Backward, with xhat = (x - mean) * rstd and g = dy * w:
    dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
    dw = sum over rows of dy * xhat;  db = sum over rows of dy   (per-program partials)
"""
import torch
import triton
import triton.language as tl

from .launch import alloc, as_rows, bwd_row_tile, cdiv, fast_launch, persistent_programs, row_tile


@fast_launch
@triton.jit
def _layer_norm_fwd_kernel(
    # pointers
    X, W, B, Y, MEAN, RSTD,
    # sizes
    M, N,
    # row strides
    stride_x, stride_y,
    eps,
    # meta-parameters
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / N
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / N + eps)
    y = xc * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean, mask=row_mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)


@fast_launch
@triton.jit
def _layer_norm_bwd_kernel(
    # pointers
    DY, X, W, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL,
    # sizes
    M, N,
    # row strides
    stride_dy, stride_x, stride_dx,
    # meta-parameters
    HAS_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    for block in range(pid, tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if HAS_WEIGHT:
            g = dy * w[None, :]
        else:
            g = dy
        c1 = tl.sum(g * xhat, axis=1) / N
        c2 = tl.sum(g, axis=1) / N
        dx = (g - c2[:, None] - xhat * c1[:, None]) * rstd[:, None]
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * xhat, axis=0)
        db += tl.sum(dy, axis=0)
    tl.store(DW_PARTIAL + pid * N + cols, dw, mask=col_mask)
    tl.store(DB_PARTIAL + pid * N + cols, db, mask=col_mask)


def layer_norm_fwd(x, weight, bias, eps):
    """Returns (y, mean, rstd); y has x's dtype promoted with the affine parameters' dtypes."""
    n = x.shape[-1]
    x2 = as_rows(x)
    m = x2.shape[0]
    out_dtype = x.dtype
    for p in (weight, bias):
        if p is not None:
            out_dtype = torch.promote_types(out_dtype, p.dtype)
    y = alloc((m, n), out_dtype, x.device)
    mean = alloc((m,), torch.float32, x.device)
    rstd = alloc((m,), torch.float32, x.device)
    block_m, block_n, warps = row_tile(n)
    if m > 0:
        _layer_norm_fwd_kernel[(cdiv(m, block_m),)](
            x2, weight if weight is not None else x2, bias if bias is not None else x2, y, mean, rstd,
            m, n, x2.stride(0), y.stride(0), eps,
            HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
        )
    return y.view(x.shape), mean, rstd


def layer_norm_bwd(dy, x, weight, mean, rstd):
    """Returns (dx, dweight, dbias); the last two are partial-sum reductions in fp32, cast at the end."""
    n = x.shape[-1]
    dy2, x2 = as_rows(dy), as_rows(x)
    m = x2.shape[0]
    dx = alloc((m, n), x.dtype, x.device)
    block_m, block_n, warps, per_sm = bwd_row_tile(n)
    progs = persistent_programs(cdiv(m, block_m), x.device, per_sm)
    dw_partial = torch.zeros((progs, n), dtype=torch.float32, device=x.device)
    db_partial = torch.zeros((progs, n), dtype=torch.float32, device=x.device)
    if m > 0:
        _layer_norm_bwd_kernel[(progs,)](
            dy2, x2, weight if weight is not None else x2, mean, rstd, dx, dw_partial, db_partial,
            m, n, dy2.stride(0), x2.stride(0), dx.stride(0),
            HAS_WEIGHT=weight is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
        )
    return dx.view(x.shape), dw_partial.sum(0), db_partial.sum(0)
