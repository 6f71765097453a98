"""Cross-entropy on an FP8 LM head's logits whose gradient is written in FP8: the kernels of
ops/fp8_cross_entropy.py (the tensorwise recipe: e5m2, one scale, both layouts).

Forward (`stats`), one program per row r of the (N, V) logits x with target t (ignore_index: no
loss, no gradient), one read:
    lse_r  = log(sum_j exp(x_rj))                  (online max m_r and sum over blocks of the vocab)
    loss_r = lse_r - x_rt
    amax_r = max_j |softmax(x_r)_j - onehot(t)_j|, exactly, from m_r, lse_r and x_rt:
             1 - p_t where x_rt is the row's maximum (every other p_j <= 1 - p_t), else
             max(1 - p_t, exp(m_r - lse_r))
and amax = max over valid rows (an atomic maximum: amaxes are >= 0).
Backward (`grad_cast`), for the loss's incoming gradient g (mean: over the valid rows' count) and the
logits' own incoming gradient dy (the logits are returned too; autograd hands zeros when nothing
used them):
    d = g * (softmax(x) - onehot(t)) + dy
cast to e5m2 with the scale of |g| * amax + max |dy| (an amax pass over dy first): the exact amax of
d when dy is zero, a bound on it otherwise (never an overflow, at most a 2x coarser scale). One read
of x per tile (dy only when its amax is not 0), q and q^T written from the same registers (with a dy,
q alone, and q^T a transposed copy of it: see grad_cast). The bf16
gradient never exists: against Inductor's backward (read x and dy, write d) followed by an amax pass
and a cast (each reading d), 3 x N x V x 2 bytes fewer move.
"""
import torch
import triton
import triton.language as tl

from .fp8 import EPS, MAX, amax_partials, cast, cast_args, cast_tiles, scale_of, tensorwise_outputs
from .launch import alloc, cdiv, interpreting, next_pow2
from .transpose import transpose_bytes


@triton.jit
def _stats_kernel(X, TARGET, LOSS, LSE, AMAX, V, stride_x, ignore_index, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    x_row = X + row.to(tl.int64) * stride_x
    t = tl.load(TARGET + row)
    valid = t != ignore_index
    cols = tl.arange(0, BLOCK_V)
    m = float("-inf")
    d = 0.0
    for off in range(0, V, BLOCK_V):
        mask = off + cols < V
        x = tl.load(x_row + off + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.where(mask, x, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(d)
    x_t = tl.load(x_row + t, mask=valid, other=0.0).to(tl.float32)
    p_t = tl.exp(x_t - lse)
    amax = tl.where(x_t >= m, 1.0 - p_t, tl.maximum(1.0 - p_t, tl.exp(m - lse)))
    tl.store(LOSS + row, tl.where(valid, lse - x_t, 0.0))
    tl.store(LSE + row, lse)
    tl.atomic_max(AMAX, tl.where(valid, amax, 0.0))


# GPU: the block is tuned once per vocabulary size (the outputs are written whole by every trial, the
# atomic maximum is the same each time)
_TUNED_STATS = triton.autotune(
    [triton.Config({"BLOCK_V": b}, num_warps=w) for b, w in ((2048, 4), (4096, 8), (8192, 8), (16384, 16))],
    key=["V"],
)(_stats_kernel)


def stats(logits: torch.Tensor, target: torch.Tensor, ignore_index: int) -> tuple:
    """(loss per row [N] fp32 (0 where ignored), lse [N] fp32, amax [] fp32) of the (N, V) logits
    (unit column stride)."""
    n, v = logits.shape
    losses = alloc((n,), torch.float32, logits.device)
    lse = alloc((n,), torch.float32, logits.device)
    amax = torch.zeros((), dtype=torch.float32, device=logits.device)
    if n == 0:
        return losses, lse, amax
    args = (logits, target, losses, lse, amax, v, logits.stride(0), ignore_index)
    if interpreting():
        _stats_kernel[(n,)](*args, BLOCK_V=min(next_pow2(max(v, 1)), 1024))
    else:
        _TUNED_STATS[(n,)](*args)
    return losses, lse, amax


def stats_reference(logits: torch.Tensor, target: torch.Tensor, ignore_index: int) -> tuple:
    """The same in torch ops."""
    x = logits.float()
    valid = target != ignore_index
    lse = x.logsumexp(-1)
    x_t = x.gather(1, target.clamp(min=0)[:, None])[:, 0]
    m = x.amax(-1)
    p_t = (x_t - lse).exp()
    amax = torch.where(x_t >= m, 1 - p_t, torch.maximum(1 - p_t, (m - lse).exp()))
    amax = torch.where(valid, amax, 0.0)
    return torch.where(valid, lse - x_t, 0.0), lse, amax.amax() if amax.numel() else amax.new_zeros(())


@triton.jit
def _grad_cast_kernel(X, LSE, TARGET, DY, PARTIAL, n_partial, DLOSS, COUNT, AMAX, Q, QT, INV, R, C, s_x, s_dy,
                      ignore_index, MEAN: tl.constexpr, HAS_DY: tl.constexpr, WRITE_Q: tl.constexpr,
                      WRITE_QT: tl.constexpr, FP8_TYPE: tl.constexpr, FP8_MAX: tl.constexpr, ROUND: tl.constexpr,
                      MANT: tl.constexpr, MIN_NORMAL: tl.constexpr, SUB_STEP: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
    """One BLOCK_R x BLOCK_C tile of d = g * (softmax(x) - onehot) + dy cast with the scale of
    |g| * AMAX + max(PARTIAL), stored at Q[r, c] and QT[c, r]; INV = the dequantization scale. HAS_DY:
    there is a dy (read only where its amax is not 0)."""
    p = tl.arange(0, BLOCK_P)
    amax_dy = tl.max(tl.load(PARTIAL + p, mask=p < n_partial, other=0.0), 0)
    g = tl.load(DLOSS).to(tl.float32)
    if MEAN:
        g = g / tl.load(COUNT)
    scale = scale_of(tl.abs(g) * tl.load(AMAX) + amax_dy, FP8_MAX)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(INV, 1.0 / scale)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_mask = rows < R
    mask = row_mask[:, None] & (cols < C)[None, :]
    t = tl.load(TARGET + rows, mask=row_mask, other=ignore_index)
    lse = tl.load(LSE + rows, mask=row_mask, other=0.0)
    g_row = tl.where(t != ignore_index, g, 0.0)
    x = tl.load(X + rows[:, None].to(tl.int64) * s_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    d = (tl.exp(x - lse[:, None]) - tl.where(cols[None, :] == t[:, None], 1.0, 0.0)) * g_row[:, None]
    if HAS_DY:  # a predicated load: where dy's amax is 0 it moves no bytes
        read = (tl.zeros_like(d) + amax_dy) != 0.0
        d += tl.load(DY + rows[:, None].to(tl.int64) * s_dy + cols[None, :], mask=mask & read, other=0.0).to(tl.float32)
    q = cast(d, scale, FP8_TYPE, FP8_MAX, ROUND, MANT, MIN_NORMAL, SUB_STEP)
    if WRITE_Q:
        tl.store(Q + rows[:, None].to(tl.int64) * C + cols[None, :], q, mask=mask)
    if WRITE_QT:
        tl.store(QT + cols[None, :].to(tl.int64) * R + rows[:, None], q, mask=mask)


# (BLOCK_R, BLOCK_C, warps): the best of 8 on the H100 at the reference step's logits, 4096 x 128256
# (benchmarks/tune_fp8_quantize.py --parts grad_cast, stop 36: 1.17 ms against 1.90 at the cast's 128 x 128 x 8)
GRAD_CAST_TILES = (32, 128, 4)


def grad_cast(logits, lse, target, dy, dloss, count, amax, ignore_index: int, mean: bool, dtype: torch.dtype,
              rows: bool = True, transposed: bool = True) -> tuple:
    """(q [N, V] or None, q^T [V, N] or None, dequantization scale [] fp32) of the logits' gradient
    d = g * (softmax - onehot) + dy (dy None: zero) cast to `dtype` with one scale; g = dloss (/ count
    for a mean), amax from `stats`."""
    n, v = logits.shape
    q, qt, inv = tensorwise_outputs(n, v, dtype, logits.device, rows, transposed)
    if n == 0 or v == 0:
        return q, qt, inv
    if dy is not None and dy.stride(1) != 1:
        dy = dy.contiguous()
    has_dy = dy is not None
    partial = amax_partials(dy) if has_dy else torch.zeros(1, dtype=torch.float32, device=logits.device)
    dy = dy if has_dy else logits  # never read
    tile_r, tile_c, warps = cast_tiles() if interpreting() else GRAD_CAST_TILES
    # with a dy, the kernel's own q^T came out unlike q's transpose on the H100 (a quarter of the elements
    # at every tile, stop 36; not so in the interpreter): there q^T is a transposed copy of q (torch's copy_
    # took 3.6 ms at 4096 x 128256, stop 37)
    direct_qt = transposed and not has_dy
    out = q if q is not None else (qt if direct_qt else alloc((n, v), dtype, logits.device))
    _grad_cast_kernel[(cdiv(n, tile_r), cdiv(v, tile_c))](
        logits, lse, target, dy, partial, partial.numel(), dloss, count, amax,
        out, qt if direct_qt else out, inv, n, v, logits.stride(0), dy.stride(0),
        ignore_index, MEAN=mean, HAS_DY=has_dy, WRITE_Q=out is not qt, WRITE_QT=direct_qt, **cast_args(dtype),
        BLOCK_R=tile_r, BLOCK_C=tile_c, BLOCK_P=next_pow2(partial.numel()), num_warps=warps)
    if transposed and not direct_qt:
        transpose_bytes(out, qt)
    return q, qt, inv


def grad_cast_reference(logits, lse, target, dy, dloss, count, amax, ignore_index: int, mean: bool,
                        dtype: torch.dtype, rows: bool = True, transposed: bool = True) -> tuple:
    """The same in torch ops."""
    x = logits.float()
    g = dloss.float() / count if mean else dloss.float()
    valid = target != ignore_index
    onehot = torch.nn.functional.one_hot(target.clamp(min=0), x.shape[1]).float()
    d = ((x - lse[:, None]).exp() - onehot) * torch.where(valid, g, 0.0)[:, None]
    amax_dy = x.new_zeros(())
    if dy is not None:
        amax_dy = dy.float().abs().amax()
        d = d + dy.float()
    scale = MAX[dtype] / (g.abs() * amax + amax_dy).clamp(min=EPS)
    q = (d * scale).clamp(-MAX[dtype], MAX[dtype]).to(dtype)
    return q if rows else None, q.t().contiguous() if transposed else None, 1.0 / scale
