"""Cross-entropy over the last dim of 2-D logits: the loss and its gradient in one kernel.

Per row r with target t (rows whose target is ignore_index give 0 loss and 0 gradient):
    lse      = log(sum_j exp(x_j))                 (online max and sum over blocks of the vocab)
    loss_r   = (1 - eps) * (lse - x_t) + eps * (lse - mean_j x_j)      (eps: label smoothing)
    dloss/dx = softmax(x) - (1 - eps) * onehot(t) - eps / V
The gradient, already scaled by `scale` (1 / valid rows for mean, 1 for sum and none), is written in
the logits' dtype; the backward only multiplies it by the incoming gradient. Logits are read twice
(statistics, then gradient) and never stored in fp32.
"""
import torch
import triton
import triton.language as tl

from .launch import alloc, interpreting


@triton.jit
def _cross_entropy_kernel(
    # pointers
    X, TARGET, SCALE, LOSS, DX,
    # sizes and strides
    V, stride_x, stride_dx,
    # scalars
    ignore_index, eps,
    # meta-parameters
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    x_row = X + row.to(tl.int64) * stride_x
    dx_row = DX + row.to(tl.int64) * stride_dx
    t = tl.load(TARGET + row)
    valid = t != ignore_index
    scale = tl.load(SCALE)
    cols = tl.arange(0, BLOCK_V)
    m = tl.full([BLOCK_V], float("-inf"), tl.float32)
    d = tl.zeros([BLOCK_V], dtype=tl.float32)
    total = tl.zeros([BLOCK_V], dtype=tl.float32)
    for off in range(0, V, BLOCK_V):
        mask = off + cols < V
        x = tl.load(x_row + off + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        # lanes that have seen no column yet keep m = -inf: their rescale factor must not be exp(nan)
        alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp(m - m_new))
        d = d * alpha + tl.where(mask, tl.exp(x - m_new), 0.0)
        m = m_new
        total += tl.where(mask, x, 0.0)
    m_all = tl.max(m, axis=0)
    lse = m_all + tl.log(tl.sum(tl.where(m == float("-inf"), 0.0, d * tl.exp(m - m_all)), axis=0))
    x_t = tl.load(x_row + t, mask=valid, other=0.0).to(tl.float32)
    loss = (1.0 - eps) * (lse - x_t) + eps * (lse - tl.sum(total, axis=0) / V)
    tl.store(LOSS + row, tl.where(valid, loss, 0.0))
    g_scale = tl.where(valid, scale, 0.0)
    for off in range(0, V, BLOCK_V):
        mask = off + cols < V
        x = tl.load(x_row + off + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) - (1.0 - eps) * tl.where(off + cols == t, 1.0, 0.0) - eps / V
        tl.store(dx_row + off + cols, (g * g_scale).to(DX.dtype.element_ty), mask=mask)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
                  label_smoothing: float = 0.0):
    """Returns (loss, dlogits): loss reduced as asked; dlogits = d(loss)/d(logits) for a unit incoming
    gradient. A mean over no valid row is 0 (eager's 0/0 is NaN)."""
    n, v = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    valid = (target != ignore_index).sum()
    count = valid.clamp(min=1).to(torch.float32)
    scale = (1.0 / count) if reduction == "mean" else torch.ones((), dtype=torch.float32, device=logits.device)
    losses = alloc((n,), torch.float32, logits.device)
    dx = alloc((n, v), logits.dtype, logits.device)
    block = min(triton.next_power_of_2(max(v, 1)), 4096 if interpreting() else 8192)
    if n > 0:
        _cross_entropy_kernel[(n,)](
            logits, target.contiguous(), scale.reshape(1), losses, dx,
            v, logits.stride(0), dx.stride(0),
            ignore_index, label_smoothing,
            BLOCK_V=block, num_warps=8 if block >= 4096 else 4,
        )
    if reduction == "none":
        return losses, dx
    total = losses.sum()
    return (total / count if reduction == "mean" else total), dx
