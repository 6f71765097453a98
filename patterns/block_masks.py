"""FlexAttention block masks built inside the graph from what a matched attention region masks.

A block mask tells FlexAttention which (128 x 128) tiles of the scores to skip (nothing kept), which
to compute without evaluating the mask (everything kept) and which need the mask element by element.
Both builders are ordinary tensor ops, so they trace into the rewritten graph and cost a few
microseconds per call:
    causal_block_mask(lq, lk)  from the block grid alone (no L x S work), mask_mod q >= k
    dense_block_mask(keep)     from a bool "kept" tensor (..., L, S) (a sliding window, a registered
                               causal buffer, a padding mask): reduced per tile; mask_mod reads it
block_density(keep) and causal_density(lq, lk) give, at compile time, the fraction of tiles left to
compute (the cost model's input).
"""
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

BLOCK = 128  # FlexAttention's default tile (its kernels are tuned for it)


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def _ordered(flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query tile: how many kv tiles are flagged and their indices first (the layout BlockMask takes)."""
    count = flags.sum(-1, dtype=torch.int32)
    order = torch.argsort(flags.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return count, order


def _from_flags(partial, full, mask_mod, lq: int, lk: int) -> BlockMask:
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(lq, lk))


def causal_block_mask(lq: int, lk: int, device) -> BlockMask:
    """Keep key j for query i when j <= i (lq == lk): tiles below the diagonal are full, the diagonal
    tiles partial, the rest skipped."""
    qb = torch.arange(_blocks(lq), device=device)[:, None]
    kb = torch.arange(_blocks(lk), device=device)[None, :]
    q_first, q_last = qb * BLOCK, torch.clamp((qb + 1) * BLOCK, max=lq) - 1
    k_first, k_last = kb * BLOCK, torch.clamp((kb + 1) * BLOCK, max=lk) - 1
    full = k_last <= q_first
    partial = (k_first <= q_last) & ~full
    return _from_flags(partial[None, None], full[None, None], lambda b, h, q, k: q >= k, lq, lk)


def _tile_flags(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) per tile of a bool (Bm, Hm, L, S) mask, in one pass over it: a tile is full
    when it keeps every one of its in-bounds positions (FlexAttention bounds the rest itself)."""
    lq, lk = keep.shape[-2:]
    nq, nk = _blocks(lq), _blocks(lk)
    padded = F.pad(keep, (0, nk * BLOCK - lk, 0, nq * BLOCK - lq), value=False)
    kept = padded.reshape(*keep.shape[:2], nq, BLOCK, nk, BLOCK).sum((-1, -3), dtype=torch.int32)
    rows = torch.clamp(lq - torch.arange(nq, device=keep.device) * BLOCK, max=BLOCK)
    cols = torch.clamp(lk - torch.arange(nk, device=keep.device) * BLOCK, max=BLOCK)
    full = kept == rows[:, None] * cols[None, :]
    return (kept > 0) & ~full, full


def dense_block_mask(keep: torch.Tensor, batch: int, heads: int) -> BlockMask:
    """keep: bool, broadcastable to (batch, heads, L, S), True where a score is kept."""
    keep = keep.reshape((1,) * (4 - keep.dim()) + tuple(keep.shape))
    partial, full = _tile_flags(keep)
    table = keep.expand(batch, heads, *keep.shape[-2:])
    return _from_flags(partial, full, lambda b, h, q, k: table[b, h, q, k], *keep.shape[-2:])


def block_density(keep: torch.Tensor) -> tuple[float, float]:
    """(fraction of (query tile, key tile) pairs with at least one kept score, fraction of them that
    are partial: FlexAttention evaluates the mask element by element there)."""
    keep = keep.reshape((1,) * (4 - keep.dim()) + tuple(keep.shape))
    partial, full = _tile_flags(keep)
    return (partial | full).float().mean().item(), partial.float().mean().item()


def causal_density(lq: int, lk: int) -> float:
    """Fraction of tiles the causal block mask computes (just over one half)."""
    kept = sum(min(_blocks(lk), (min((qb + 1) * BLOCK, lq) - 1) // BLOCK + 1) for qb in range(_blocks(lq)))
    return kept / (_blocks(lq) * _blocks(lk))
