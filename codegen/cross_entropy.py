"""Cross-entropy over the last dim of 2-D logits: the loss and its gradient in one kernel.

Per row r with target t (rows whose target is ignore_index give 0 loss and 0 gradient):
    x        = cap * tanh(z / cap) with logit soft-capping (Gemma 2), else the logits z
    lse      = log(sum_j exp(x_j))                 (online max and sum over blocks of the vocab)
    loss_r   = (1 - eps) * (lse - x_t) + eps * (lse - mean_j x_j)      (eps: label smoothing)
    dloss/dx = softmax(x) - (1 - eps) * onehot(t) - eps / V;  dloss/dz = dloss/dx * (1 - (x / cap)^2)
The gradient, already scaled by `scale` (1 / valid rows for mean, 1 for sum and none), is written in
the logits' dtype, in place of the logits if asked (the chunked linear + cross-entropy does); the
backward only multiplies it by the incoming gradient. Logits are read twice (statistics, then
gradient) and never stored in fp32.
"""
import torch
import triton
import triton.language as tl

from .launch import alloc, interpreting, next_pow2


@triton.jit
def _tanh(x):
    # 1 - 2 / (exp(2x) + 1): exact at both ends (exp overflows to inf: 1; underflows to 0: -1)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _cross_entropy_kernel(
    # pointers
    X, TARGET, SCALE, LOSS, DX,
    # sizes and strides
    V, stride_x, stride_dx,
    # scalars
    ignore_index, eps, cap,
    # meta-parameters
    BLOCK_V: tl.constexpr, SOFTCAP: tl.constexpr,
):
    row = tl.program_id(0)
    x_row = X + row.to(tl.int64) * stride_x
    dx_row = DX + row.to(tl.int64) * stride_dx
    t = tl.load(TARGET + row)
    valid = t != ignore_index
    scale = tl.load(SCALE)
    cols = tl.arange(0, BLOCK_V)
    m = float("-inf")  # running max and sum of exp(x - m) over the row (online softmax, one exp per element)
    d = 0.0
    total = 0.0
    for off in range(0, V, BLOCK_V):
        mask = off + cols < V
        x = tl.load(x_row + off + cols, mask=mask, other=0.0).to(tl.float32)
        if SOFTCAP:
            x = cap * _tanh(x / cap)
        x = tl.where(mask, x, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
        total += tl.sum(tl.where(mask, x, 0.0), axis=0)
    lse = m + tl.log(d)
    x_t = tl.load(x_row + t, mask=valid, other=0.0).to(tl.float32)
    if SOFTCAP:
        x_t = cap * _tanh(x_t / cap)
    loss = (1.0 - eps) * (lse - x_t) + eps * (lse - total / V)
    tl.store(LOSS + row, tl.where(valid, loss, 0.0))
    g_scale = tl.where(valid, scale, 0.0)
    for off in range(0, V, BLOCK_V):
        mask = off + cols < V
        x = tl.load(x_row + off + cols, mask=mask, other=0.0).to(tl.float32)
        if SOFTCAP:
            th = _tanh(x / cap)
            x = cap * th
        g = tl.exp(x - lse) - (1.0 - eps) * tl.where(off + cols == t, 1.0, 0.0) - eps / V
        if SOFTCAP:
            g = g * (1.0 - th * th)
        tl.store(dx_row + off + cols, (g * g_scale).to(DX.dtype.element_ty), mask=mask)


# GPU: the tile is tuned once per vocabulary size (X and DX restored between trials: DX may be X)
_TUNED = triton.autotune(
    [triton.Config({"BLOCK_V": b}, num_warps=w) for b, w in ((4096, 8), (8192, 8), (16384, 16), (32768, 32))],
    key=["V", "SOFTCAP"], restore_value=["X", "DX"],
)(_cross_entropy_kernel)


def launch_rows(logits: torch.Tensor, target: torch.Tensor, scale: torch.Tensor, losses: torch.Tensor,
                dx: torch.Tensor, ignore_index: int, label_smoothing: float, softcap: float) -> None:
    """One program per row of the (N, V) logits (unit column stride): losses[r] and the scaled
    gradient dx[r] (dx may be the logits themselves: each element is read before it is written)."""
    n, v = logits.shape
    if n == 0:
        return
    args = (logits, target, scale.reshape(1), losses, dx, v, logits.stride(0), dx.stride(0),
            ignore_index, label_smoothing, softcap if softcap else 1.0)
    if interpreting():
        _cross_entropy_kernel[(n,)](*args, BLOCK_V=min(next_pow2(max(v, 1)), 4096),
                                    SOFTCAP=bool(softcap))
    else:
        _TUNED[(n,)](*args, SOFTCAP=bool(softcap))


def loss_scale(target: torch.Tensor, ignore_index: int, reduction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(count of valid rows, at least 1; the gradient's scale: 1 / count for mean, else 1)."""
    count = (target != ignore_index).sum().clamp(min=1).to(torch.float32)
    scale = (1.0 / count) if reduction == "mean" else torch.ones((), dtype=torch.float32, device=target.device)
    return count, scale


def reduce(losses: torch.Tensor, count: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return losses
    total = losses.sum()
    return total / count if reduction == "mean" else total


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
                  label_smoothing: float = 0.0, softcap: float = 0.0):
    """Returns (loss, dlogits): loss reduced as asked; dlogits = d(loss)/d(logits) for a unit incoming
    gradient. A mean over no valid row is 0 (eager's 0/0 is NaN)."""
    n, v = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    count, scale = loss_scale(target, ignore_index, reduction)
    losses = alloc((n,), torch.float32, logits.device)
    dx = alloc((n, v), logits.dtype, logits.device)
    launch_rows(logits, target.contiguous(), scale, losses, dx, ignore_index, label_smoothing, softcap)
    return reduce(losses, count, reduction), dx
