"""Top-k over short rows (an MoE router's expert scores) in one launch: a program holds BLOCK_T whole rows
and runs Triton's bitonic top-k (tl.topk) over keys that carry each entry's column. torch.topk runs a
radix select per row and then sorts the k winners (two launches; on the H100 29 us for 8192 rows of 8,
133 us for 16384 rows of 128).

Results match torch.topk(x, k, dim=-1) (largest, sorted): values in descending order, NaN ranked above
every number; among equal values the lowest index comes first (torch leaves that order unspecified).
Indices are int64, values keep x's dtype.
"""
import torch
import triton
import triton.language as tl

from .launch import alloc, as_rows, cdiv, fast_launch, interpreting, next_pow2

MAX_WIDTH = 4096  # widest row one program keeps in registers
MAX_K = 64  # largest k (its power of two is the width of the bitonic merge)


@fast_launch
@triton.jit
def _topk_kernel(X, VALUES, INDICES, n_rows, E, sx, K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_E: tl.constexpr):
    """Each entry as one int64 key, its float's bits made to order as signed integers (NaN above all,
    padding below all) over the inverted column (lower columns win ties); Triton's bitonic top-k of
    BLOCK_K = next_pow2(K) keys per row; values and indices decoded from the keys."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    r_mask = rows < n_rows
    mask = r_mask[:, None] & (cols < E)[None, :]
    x = tl.load(X + rows[:, None].to(tl.int64) * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: magnitude bits flipped
    key = tl.where(x != x, 0x7FFFFFFF, key)
    key = tl.where(mask, key, -2147483648)
    packed = (key.to(tl.int64) << 32) | (BLOCK_E - 1 - cols).to(tl.int64)[None, :]
    top = tl.topk(packed, BLOCK_K, dim=1)
    key = (top >> 32).to(tl.int32)
    value = (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    index = BLOCK_E - 1 - top.to(tl.int32)
    slots = tl.arange(0, BLOCK_K)
    out = rows[:, None].to(tl.int64) * K + slots[None, :]
    out_mask = r_mask[:, None] & (slots < K)[None, :]
    tl.store(VALUES + out, value.to(VALUES.dtype.element_ty), mask=out_mask)
    tl.store(INDICES + out, index.to(tl.int64), mask=out_mask)


def supports(x: torch.Tensor, k: int) -> str | None:
    """None when topk_rows takes a row width and k, else why not."""
    width = x.shape[-1] if x.dim() else 1
    if width > MAX_WIDTH:
        return f"rows of {width} > {MAX_WIDTH}"
    if not 0 < k <= min(width, MAX_K):
        return f"k = {k} outside 1 .. {min(width, MAX_K)}"
    return None


def topk_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest entries of each row of x [..., E], as torch.topk(x, k, -1)."""
    width = x.shape[-1]
    x2 = as_rows(x)
    rows = x2.shape[0]
    values = alloc((rows, k), x.dtype, x.device)
    indices = alloc((rows, k), torch.int64, x.device)
    block_e = next_pow2(width)
    block_t = max(1, min(64 if interpreting() else 32, 2048 // block_e))
    if rows:
        _topk_kernel[(cdiv(rows, block_t),)](x2, values, indices, rows, width, x2.stride(0), K=k,
                                             BLOCK_K=next_pow2(k), BLOCK_T=block_t, BLOCK_E=block_e, num_warps=4)
    return values.view(*x.shape[:-1], k), indices.view(*x.shape[:-1], k)
