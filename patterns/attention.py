"""Attention family: hand-written attention becomes one fused scaled_dot_product_attention call.

Spellings matched (q, k, v of shape (..., L, D); k and v may be repeat_kv'd for GQA/MQA: they bind
as they are):
    scores by q @ k.transpose(-2, -1) (torch.matmul, @, 4-D or 3-D) scaled by * c or / c after the
    matmul, or q * c before it (canonicalized to after: every mask variant takes it); softmax in the input dtype or upcast to fp32 and back;
    masks: none, an additive float mask (HF eager), masked_fill(bool mask, -inf) (nanoGPT's buffer
    slice, padding masks), causal built in the graph with triu(ones(L, S, bool), 1).
Emitted: F.scaled_dot_product_attention, made contiguous like the matmul it replaces; is_causal (the
flash kernel) for a causal mask built in the graph, whether spelled as triu(ones) or computed from
constants (HF's eager mask: evaluated at compile time and checked to be causal).
    dropout on the probabilities (training): SDPA's dropout_p; its random mask is not eager's (same
    distribution, other draws);
    einsum("bhqd,bhkd->bhqk") scores (canonicalized to matmul).
    logit soft-capping tanh(scores / cap) * cap (Gemma 2), then a mask (bool masked_fill, causal triu
    built in the graph, or additive): SDPA cannot express it, so it becomes FlexAttention with the
    score_mod derived from the match (Inductor compiles it into one fused kernel, forward and
    backward) and a block mask: causal masks known at compile time become the causal block mask (no
    mask read), other bool or pure (0 / -inf) constant masks a block mask reduced from the mask in
    the graph, so the tiles it masks entirely are skipped.
    constant masks that are not causal (sliding windows, prefix-LM): FlexAttention with that block
    mask when the tiles it skips make it cheaper than SDPA reading the mask (cost model, density
    measured from the constant at compile time); else SDPA with the mask.
    a bool mask from a graph input (nanoGPT's registered causal buffer, a padding mask): FlexAttention
    with a block mask reduced from it at every call when the first call's mask has enough empty
    tiles to beat SDPA reading the mask (a cost hint only: any mask value gives the right result).
ALiBi and relative position biases added as tensors are additive masks (SDPA's attn_mask, gradient
included). Kernel efficiencies per length: cost.py, measured on the H200.
"""
import dataclasses

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from fusion_compiler import cost
from fusion_compiler.constants import constant_value, example_value, is_causal_mask
from fusion_compiler.pattern import register_pattern

from .block_masks import block_density, causal_block_mask, causal_density, dense_block_mask
from .checks import float_dtype, one_device


SCALE = 0.123456  # distinctive example value: the traced literal equal to it binds `scale`
MAX_HEAD_DIM = 256  # the fused SDPA kernels' limit


def _scores(q, k, scale):
    return q @ k.transpose(-2, -1) * scale


# --- search functions --------------------------------------------------------------------------------
def _dropped(probs, keep):
    """F.dropout(probs, 1 - keep, training=True), written as it canonicalizes (keep binds exactly)."""
    return probs * (torch.empty_like(probs).bernoulli_(keep) / keep)


def attention(q, k, v, scale):
    """before: softmax(q @ k^T * scale) @ v              after: sdpa(q, k, v, scale=scale)"""
    return torch.softmax(_scores(q, k, scale), dim=-1) @ v


def attention_additive_mask(q, k, v, mask, scale):
    """before: softmax(q @ k^T * scale + mask) @ v       after: sdpa(q, k, v, attn_mask=mask, scale=scale)"""
    return torch.softmax(_scores(q, k, scale) + mask, dim=-1) @ v


def attention_bool_mask(q, k, v, masked, scale):
    """before: softmax((q @ k^T * scale).masked_fill(masked, -inf)) @ v
    after:  sdpa(q, k, v, attn_mask=~masked, scale=scale)"""
    return torch.softmax(_scores(q, k, scale).masked_fill(masked, float("-inf")), dim=-1) @ v


def _causal_scores(q, k, scale):
    lq, lk = q.shape[-2], k.shape[-2]
    masked = torch.triu(torch.ones(lq, lk, dtype=torch.bool, device=q.device), diagonal=1)
    return _scores(q, k, scale).masked_fill(masked, float("-inf"))


def attention_causal(q, k, v, scale):
    """before: the same with masked = triu(ones(L, S, bool), 1) built in the graph
    after:  sdpa(q, k, v, is_causal=True, scale=scale)"""
    return torch.softmax(_causal_scores(q, k, scale), dim=-1) @ v


def attention_dropout(q, k, v, scale, keep):
    """before: dropout(softmax(q @ k^T * scale), 1 - keep) @ v   after: sdpa(..., dropout_p=1 - keep)"""
    return _dropped(torch.softmax(_scores(q, k, scale), dim=-1), keep) @ v


def attention_additive_mask_dropout(q, k, v, mask, scale, keep):
    """before: dropout(softmax(q @ k^T * scale + mask), 1 - keep) @ v (HF eager attention in training)
    after:  sdpa(q, k, v, attn_mask=mask, dropout_p=1 - keep, scale=scale)"""
    return _dropped(torch.softmax(_scores(q, k, scale) + mask, dim=-1), keep) @ v


def attention_bool_mask_dropout(q, k, v, masked, scale, keep):
    """before: dropout(softmax(scores.masked_fill(masked, -inf)), 1 - keep) @ v (nanoGPT in training)
    after:  sdpa(q, k, v, attn_mask=~masked, dropout_p=1 - keep, scale=scale)"""
    return _dropped(torch.softmax(_scores(q, k, scale).masked_fill(masked, float("-inf")), dim=-1), keep) @ v


def attention_causal_dropout(q, k, v, scale, keep):
    """before: dropout(softmax(causal scores), 1 - keep) @ v  after: sdpa(..., is_causal=True, dropout_p=1 - keep)"""
    return _dropped(torch.softmax(_causal_scores(q, k, scale), dim=-1), keep) @ v


def _softcapped(q, k, scale, cap):
    return torch.tanh(_scores(q, k, scale) / cap) * cap


def attention_softcap(q, k, v, scale, cap):
    """before: softmax(tanh(q @ k^T * scale / cap) * cap) @ v   after: flex_attention(score_mod=softcap)"""
    return torch.softmax(_softcapped(q, k, scale, cap), dim=-1) @ v


def attention_softcap_mask(q, k, v, mask, scale, cap):
    """before: softmax(tanh(q @ k^T * scale / cap) * cap + mask) @ v (HF Gemma 2 eager)
    after:  flex_attention(score_mod=softcap then + mask[b, h, q, k])"""
    return torch.softmax(_softcapped(q, k, scale, cap) + mask, dim=-1) @ v


def attention_softcap_bool_mask(q, k, v, masked, scale, cap):
    """before: softmax((tanh(q @ k^T * scale / cap) * cap).masked_fill(masked, -inf)) @ v
    after:  flex_attention(score_mod=softcap, block_mask from ~masked)"""
    return torch.softmax(_softcapped(q, k, scale, cap).masked_fill(masked, float("-inf")), dim=-1) @ v


def attention_softcap_causal(q, k, v, scale, cap):
    """before: the same with masked = triu(ones(L, S, bool), 1) built in the graph
    after:  flex_attention(score_mod=softcap, causal block mask)"""
    lq, lk = q.shape[-2], k.shape[-2]
    masked = torch.triu(torch.ones(lq, lk, dtype=torch.bool, device=q.device), diagonal=1)
    return torch.softmax(_softcapped(q, k, scale, cap).masked_fill(masked, float("-inf")), dim=-1) @ v


# --- replacements ------------------------------------------------------------------------------------
def _flex(q, k, v, scale, cap=None, mask=None, keep=None, causal=False):
    """FlexAttention: score_mod = soft-cap (cap) then + mask (additive, read per score); block mask =
    causal, or reduced from the bool `keep`."""
    batch, heads, lq, lk = q.shape[0], q.shape[1], q.shape[-2], k.shape[-2]
    if mask is not None:
        mask = mask.to(q.dtype).expand(batch, heads, lq, lk)

    def score_mod(s, b, h, qi, ki):
        if cap is not None:
            s = torch.tanh(s / cap) * cap
        return s + mask[b, h, qi, ki] if mask is not None else s

    blocks = causal_block_mask(lq, lk, q.device) if causal else \
        dense_block_mask(keep, batch, heads) if keep is not None else None
    mod = score_mod if cap is not None or mask is not None else None
    return flex_attention(q, k, v, score_mod=mod, block_mask=blocks, scale=scale).contiguous()


def _sdpa(q, k, v, scale, mask=None, causal=False, keep=1.0):
    """SDPA's fused kernels take (B, H, L, D) only; other ranks run its math kernel, slower than
    Inductor (bmm on flattened heads, H200: 10.4 ms against Inductor's 2.1). Leading dims are
    folded to (B, H) and unfolded after."""
    lead, lq, lk = q.shape[:-2], q.shape[-2], k.shape[-2]
    if q.dim() != 4:
        q, k, v = (t.reshape(-1, *t.shape[-3:]) if t.dim() > 4 else t[None] for t in (q, k, v))
        if mask is not None and mask.dim() > 2:
            mask = mask.expand(*lead, lq, lk).reshape(*q.shape[:2], lq, lk)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                         dropout_p=1.0 - keep)
    return out.reshape(*lead, lq, out.shape[-1]).contiguous()


# --- checks ------------------------------------------------------------------------------------------
def _legal(match) -> str | None:
    tensors = match.tensor_inputs()
    q, k, v = tensors[:3]
    # mixed devices (SDPA runs on CPU and CUDA alike), or float64/integer q/k/v
    why = one_device(tensors) or float_dtype(q)
    if why:
        return why
    # SDPA needs one dtype for q, k and v
    if not q.dtype == k.dtype == v.dtype:
        return f"q/k/v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})"
    # batch/head dims must agree (SDPA broadcasts less than matmul does)
    if q.dim() < 3 or q.shape[:-2] != k.shape[:-2] or k.shape[:-1] != v.shape[:-1]:
        return f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} are not (..., L, D) alike"
    # no fused kernel for wide heads: the math fallback would be no faster than Inductor
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head dim {q.shape[-1]} > {MAX_HEAD_DIM}"
    return None


def _flex_legal(legal):
    def check(match) -> str | None:
        q = match.tensor_inputs()[0]
        # FlexAttention takes (B, H, L, D)
        return legal(match) or (None if q.dim() == 4 else f"q {list(q.shape)} is not (B, H, L, D) for FlexAttention")
    return check


def _mask_legal(match) -> str | None:
    why = _legal(match)
    if why:
        return why
    q, k, _, mask = match.tensor_inputs()[:4]
    # a float mask is added to the scores, a bool mask selects them: anything else is not a mask
    if not (mask.dtype == torch.bool or mask.is_floating_point()):
        return f"mask dtype {mask.dtype}"
    # the mask must broadcast to the scores without changing their shape
    try:
        ok = torch.broadcast_shapes(mask.shape, (*q.shape[:-1], k.shape[-2])) == (*q.shape[:-1], k.shape[-2])
    except RuntimeError:
        ok = False
    if not ok:
        return f"mask {list(mask.shape)} does not broadcast to the scores {[*q.shape[:-1], k.shape[-2]]}"
    return None


def _pure_keep(value: torch.Tensor, additive: bool):
    """The kept positions of a constant mask that only keeps or drops (bool; additive 0 or <= half the
    dtype's lowest value), else None (a bias that also reweights scores)."""
    if not additive:
        return ~value if value.dtype == torch.bool else None
    if not value.is_floating_point():
        return None
    keep = value == 0
    return keep if bool((keep | (value <= torch.finfo(value.dtype).min / 2)).all()) else None


def _constant_mask_legal(additive: bool, causal: bool, flex: bool = False):
    """A mask computed from constants only: causal (flash's is_causal, or FlexAttention's causal block
    mask), or for causal=False a pure keep/drop mask that is not causal (FlexAttention's block mask)."""
    def legal(match) -> str | None:
        why = (_flex_legal(_mask_legal) if flex else _mask_legal)(match)
        if why:
            return why
        mask_node = match.inputs[3]
        value = constant_value(mask_node) if hasattr(mask_node, "meta") else None
        # a mask computed from graph inputs (padding, a buffer) may change from call to call
        if value is None:
            return "mask is computed from graph inputs: not known at compile time"
        if is_causal_mask(value, additive) != causal:
            return "constant mask is not causal" if causal else "constant mask is causal"
        if not causal and _pure_keep(value, additive) is None:
            return "constant additive mask also reweights scores (not only 0 / -inf)"
        return None
    return legal


def _should(kernel: str):
    """Cost of a kernel that computes every score tile (flash_causal: half of them)."""
    density = 0.5 if kernel == "flash_causal" else 1.0
    return lambda match, ctx: cost.estimate_attention(match, ctx, kernel, density)


def _should_flex_causal(match, ctx):
    q, k = match.tensor_inputs()[:2]
    return cost.estimate_attention(match, ctx, "flex_score_mod", causal_density(q.shape[-2], k.shape[-2]))


PARTIAL_TILE_COST = 1.5  # a partial tile reads the mask per score (assumed, not measured alone)


def _mask_density(match, additive: bool) -> tuple[float, str]:
    """Work on the score tiles the region's mask keeps, in whole tiles (partial ones cost
    PARTIAL_TILE_COST): counted on its value when known at compile time (a constant), else on the
    first call's inputs (a hint: nanoGPT's buffer), else every tile, partial."""
    value = example_value(match.inputs[3]) if hasattr(match.inputs[3], "meta") else None
    keep = _pure_keep(value, additive) if value is not None else None
    if keep is None:
        return PARTIAL_TILE_COST, "mask unknown at compile time: every tile counted, partial"
    kept, partial = block_density(keep)
    return kept + (PARTIAL_TILE_COST - 1) * partial, f"tiles counted on the mask's value: {kept:.0%} kept, " \
        f"{partial:.0%} partial"


def _should_flex(kernel: str, additive: bool, against_sdpa: bool):
    """FlexAttention over the tiles the mask keeps, against the unfused graph; with against_sdpa, kept
    off when SDPA reading the whole mask (every tile) is estimated cheaper."""
    def should(match, ctx):
        density, source = _mask_density(match, additive)
        flex = cost.estimate_attention(match, ctx, kernel, density)
        flex = dataclasses.replace(flex, note=f"{flex.note}; {source}")
        sdpa = cost.estimate_attention(match, ctx, "sdpa_mask")
        if against_sdpa and sdpa.ours_s < flex.ours_s:
            return cost.Estimate(flex.ours_s, sdpa.ours_s, flex.ours_bytes, sdpa.ours_bytes, "SDPA with the mask",
                                 flex.note)
        return flex
    return should


_QKV = [torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 8)]
_CAUSAL_QKV = [torch.randn(2, 3, 7, 8), *_QKV[1:]]
_MASK = torch.randn(2, 1, 5, 7)
_MASKED = torch.rand(1, 1, 5, 7) > 0.5
KEEP = 0.876543  # distinctive example value of the dropout keep probability


def _register(name, search, replacement, examples, legal, kernel="flash", priority=30, should=None):
    register_pattern(name, family="attention", kernel=kernel, search=search, replacement=replacement,
                     example_inputs=examples, can_apply=legal, should_apply=should or _should(kernel),
                     priority=priority)


_register("attention", attention, lambda q, k, v, scale: _sdpa(q, k, v, scale), [*_QKV, SCALE], _legal)
_register("attention_additive_mask", attention_additive_mask,
          lambda q, k, v, mask, scale: _sdpa(q, k, v, scale, mask=mask.to(q.dtype)),
          [*_QKV, _MASK, SCALE], _mask_legal, "sdpa_mask", priority=40)
_register("attention_bool_mask", attention_bool_mask,
          lambda q, k, v, masked, scale: _sdpa(q, k, v, scale, mask=~masked),
          [*_QKV, _MASKED, SCALE], _mask_legal, "sdpa_mask", priority=40)
_register("attention_causal", attention_causal, lambda q, k, v, scale: _sdpa(q, k, v, scale, causal=True),
          [*_CAUSAL_QKV, SCALE], _legal, "flash_causal", priority=50)
# a mask the graph builds from constants and that is causal: flash's is_causal instead of a mask read
_register("attention_causal_mask", attention_additive_mask,
          lambda q, k, v, mask, scale: _sdpa(q, k, v, scale, causal=True),
          [*_QKV, _MASK, SCALE], _constant_mask_legal(additive=True, causal=True), "flash_causal", priority=45)
_register("attention_causal_bool_mask", attention_bool_mask,
          lambda q, k, v, masked, scale: _sdpa(q, k, v, scale, causal=True),
          [*_QKV, _MASKED, SCALE], _constant_mask_legal(additive=False, causal=True), "flash_causal", priority=45)
# other masks: FlexAttention skips the tiles they mask entirely (sliding windows, causal buffers)
_register("attention_block_mask", attention_additive_mask,
          lambda q, k, v, mask, scale: _flex(q, k, v, scale, keep=mask == 0),
          [*_QKV, _MASK, SCALE], _constant_mask_legal(additive=True, causal=False, flex=True), "flex", priority=44,
          should=_should_flex("flex", additive=True, against_sdpa=True))
_register("attention_block_bool_mask", attention_bool_mask,
          lambda q, k, v, masked, scale: _flex(q, k, v, scale, keep=~masked),
          [*_QKV, _MASKED, SCALE], _flex_legal(_mask_legal), "flex", priority=44,
          should=_should_flex("flex", additive=False, against_sdpa=True))
# with dropout on the probabilities (training): larger regions, so they run first
_register("attention_dropout", attention_dropout,
          lambda q, k, v, scale, keep: _sdpa(q, k, v, scale, keep=keep), [*_QKV, SCALE, KEEP], _legal, priority=60)
_register("attention_additive_mask_dropout", attention_additive_mask_dropout,
          lambda q, k, v, mask, scale, keep: _sdpa(q, k, v, scale, mask=mask.to(q.dtype), keep=keep),
          [*_QKV, _MASK, SCALE, KEEP], _mask_legal, "sdpa_mask", priority=70)
_register("attention_bool_mask_dropout", attention_bool_mask_dropout,
          lambda q, k, v, masked, scale, keep: _sdpa(q, k, v, scale, mask=~masked, keep=keep),
          [*_QKV, _MASKED, SCALE, KEEP], _mask_legal, "sdpa_mask", priority=70)
_register("attention_causal_mask_dropout", attention_additive_mask_dropout,
          lambda q, k, v, mask, scale, keep: _sdpa(q, k, v, scale, causal=True, keep=keep),
          [*_QKV, _MASK, SCALE, KEEP], _constant_mask_legal(additive=True, causal=True), "flash_causal", priority=75)
_register("attention_causal_dropout", attention_causal_dropout,
          lambda q, k, v, scale, keep: _sdpa(q, k, v, scale, causal=True, keep=keep),
          [*_CAUSAL_QKV, SCALE, KEEP], _legal, "flash_causal", priority=80)
# logit soft-capping (Gemma 2): FlexAttention, with the tightest block mask the mask allows
CAP = 29.87654  # distinctive example value of the soft-cap
_register("attention_softcap", attention_softcap, lambda q, k, v, scale, cap: _flex(q, k, v, scale, cap),
          [*_QKV, SCALE, CAP], _flex_legal(_legal), "flex_score_mod", priority=60)
_register("attention_softcap_causal", attention_softcap_causal,
          lambda q, k, v, scale, cap: _flex(q, k, v, scale, cap, causal=True),
          [*_CAUSAL_QKV, SCALE, CAP], _flex_legal(_legal), "flex_score_mod", priority=80, should=_should_flex_causal)
_register("attention_softcap_causal_mask", attention_softcap_mask,
          lambda q, k, v, mask, scale, cap: _flex(q, k, v, scale, cap, causal=True),
          [*_QKV, _MASK, SCALE, CAP], _constant_mask_legal(additive=True, causal=True, flex=True), "flex_score_mod",
          priority=75, should=_should_flex_causal)
_register("attention_softcap_causal_bool_mask", attention_softcap_bool_mask,
          lambda q, k, v, masked, scale, cap: _flex(q, k, v, scale, cap, causal=True),
          [*_QKV, _MASKED, SCALE, CAP], _constant_mask_legal(additive=False, causal=True, flex=True),
          "flex_score_mod", priority=75, should=_should_flex_causal)
_register("attention_softcap_block_mask", attention_softcap_mask,
          lambda q, k, v, mask, scale, cap: _flex(q, k, v, scale, cap, keep=mask == 0),
          [*_QKV, _MASK, SCALE, CAP], _constant_mask_legal(additive=True, causal=False, flex=True), "flex_score_mod",
          priority=72, should=_should_flex("flex_score_mod", additive=True, against_sdpa=False))
_register("attention_softcap_bool_mask", attention_softcap_bool_mask,
          lambda q, k, v, masked, scale, cap: _flex(q, k, v, scale, cap, keep=~masked),
          [*_QKV, _MASKED, SCALE, CAP], _flex_legal(_mask_legal), "flex_score_mod", priority=70,
          should=_should_flex("flex_score_mod", additive=False, against_sdpa=False))
_register("attention_softcap_mask", attention_softcap_mask,
          lambda q, k, v, mask, scale, cap: _flex(q, k, v, scale, cap, mask=mask),
          [*_QKV, _MASK, SCALE, CAP], _flex_legal(_mask_legal), "flex_score_mod", priority=68)
