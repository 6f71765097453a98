"""Linear + cross-entropy in chunks of tokens: the (N, V) logits never exist whole.

For each chunk of rows of the hidden states h (N, H):
    logits_c = h_c @ W^T (+ b)                       cuBLAS, into one reused (rows, V) buffer
    loss_c, dlogits_c                                 the cross-entropy kernel (codegen/cross_entropy.py),
                                                      the gradient written over the logits in place
    dh_c = dlogits_c @ W;  dW += dlogits_c^T @ h_c;  db += sum_rows dlogits_c     (training only)
For a mean or a sum the gradients are those of a unit incoming gradient (scaled by 1 / valid tokens
for a mean), computed in the forward; the backward only multiplies them by the incoming gradient.
Per-token losses (reduction none) get one incoming gradient per row: the backward runs the chunks
again with `row_grad`, each row of dlogits scaled by it (one more logits GEMM than Inductor). The chunk holds at most `budget`
bytes of logits: a quarter of the free device memory, capped at CHUNK_BYTES (256 MiB: 1024 rows of
a 128K vocabulary in bf16). Fewer rows would save memory but cost time: each chunk reads and
writes the whole dW accumulator (0.5 GiB for 128K x 2048 in bf16) once more.
"""
import torch

from . import cross_entropy as ce
from .launch import alloc

CHUNK_BYTES = 256 << 20
MIN_ROWS = 64  # fewer rows per GEMM waste the tensor cores


def chunk_rows(n: int, v: int, element_size: int, device: torch.device, budget: int | None = None) -> int:
    """Rows per chunk: as many as the byte budget allows, a multiple of MIN_ROWS, at most n."""
    if budget is None:
        budget = CHUNK_BYTES
        if device.type == "cuda":
            budget = min(budget, torch.cuda.mem_get_info(device)[0] // 4)
    rows = max(MIN_ROWS, budget // max(1, v * element_size) // MIN_ROWS * MIN_ROWS)
    return max(1, min(n, rows))


def linear_cross_entropy(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor,
                         ignore_index: int, reduction: str, label_smoothing: float, softcap: float,
                         with_grad: bool, budget: int | None = None, row_grad: torch.Tensor | None = None):
    """Returns (loss, dh, dw, db); the gradients are None unless with_grad (db also without a bias).
    row_grad (N,): the incoming gradient of per-token losses (reduction none), applied per row."""
    n, v = h.shape[0], w.shape[0]
    h, target = h.contiguous(), target.contiguous()
    count, scale = ce.loss_scale(target, ignore_index, reduction)
    losses = alloc((n,), torch.float32, h.device)
    dh = alloc(h.shape, h.dtype, h.device) if with_grad else None
    dw = torch.empty_like(w) if with_grad else None
    db = torch.zeros(v, dtype=torch.float32, device=h.device) if with_grad and b is not None else None
    rows = chunk_rows(n, v, h.element_size(), h.device, budget)
    buf = torch.empty((rows, v), dtype=h.dtype, device=h.device)
    for start in range(0, n, rows):
        end = min(start + rows, n)
        h_c, logits = h[start:end], buf[: end - start]
        if b is None:
            torch.mm(h_c, w.t(), out=logits)
        else:
            torch.addmm(b, h_c, w.t(), out=logits)
        ce.launch_rows(logits, target[start:end], scale, losses[start:end], logits, ignore_index,
                       label_smoothing, softcap)
        if row_grad is not None:
            logits.mul_(row_grad[start:end, None])
        if with_grad:
            torch.mm(logits, w, out=dh[start:end])
            if start == 0:
                torch.mm(logits.t(), h_c, out=dw)
            else:
                dw.addmm_(logits.t(), h_c)
            if db is not None:
                db += logits.sum(0, dtype=torch.float32)
    loss = ce.reduce(losses, count, reduction)
    return loss, dh, dw, (db.to(b.dtype) if db is not None else None)
