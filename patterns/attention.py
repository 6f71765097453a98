"""Attention family: hand-written attention becomes one fused scaled_dot_product_attention call.

Spellings matched (q, k, v of shape (..., L, D); k and v may be repeat_kv'd for GQA/MQA: they bind
as they are):
    scores by q @ k.transpose(-2, -1) (torch.matmul, @, 4-D or 3-D) scaled by * c or / c after the
    matmul, or q * c before it; softmax in the input dtype or upcast to fp32 and back;
    masks: none, an additive float mask (HF eager), masked_fill(bool mask, -inf) (nanoGPT's buffer
    slice, padding masks), causal built in the graph with triu(ones(L, S, bool), 1).
Emitted: F.scaled_dot_product_attention (is_causal for the built-in causal mask, so the flash kernel
applies), made contiguous like the matmul it replaces.
Not yet matched (left to Inductor, no decision): dropout on the probabilities, einsum scores,
score modifications (soft-capping, ALiBi, sliding windows, relative bias) and FlexAttention.
"""
import torch
import torch.nn.functional as F

from fusion_compiler import cost
from fusion_compiler.pattern import register_pattern

from fusion_compiler.ops import SUPPORTED_DTYPES

SCALE = 0.123456  # distinctive example value: the traced literal equal to it binds `scale`
MAX_HEAD_DIM = 256  # the fused SDPA kernels' limit


def _scores(q, k, scale):
    return q @ k.transpose(-2, -1) * scale


# --- search functions --------------------------------------------------------------------------------
def attention(q, k, v, scale):
    """before: softmax(q @ k^T * scale) @ v              after: sdpa(q, k, v, scale=scale)"""
    return torch.softmax(_scores(q, k, scale), dim=-1) @ v


def attention_prescaled_q(q, k, v, scale):
    """before: softmax((q * scale) @ k^T) @ v            after: sdpa(q, k, v, scale=scale)"""
    return torch.softmax((q * scale) @ k.transpose(-2, -1), dim=-1) @ v


def attention_additive_mask(q, k, v, mask, scale):
    """before: softmax(q @ k^T * scale + mask) @ v       after: sdpa(q, k, v, attn_mask=mask, scale=scale)"""
    return torch.softmax(_scores(q, k, scale) + mask, dim=-1) @ v


def attention_bool_mask(q, k, v, masked, scale):
    """before: softmax((q @ k^T * scale).masked_fill(masked, -inf)) @ v
    after:  sdpa(q, k, v, attn_mask=~masked, scale=scale)"""
    return torch.softmax(_scores(q, k, scale).masked_fill(masked, float("-inf")), dim=-1) @ v


def attention_causal(q, k, v, scale):
    """before: the same with masked = triu(ones(L, S, bool), 1) built in the graph
    after:  sdpa(q, k, v, is_causal=True, scale=scale)"""
    lq, lk = q.shape[-2], k.shape[-2]
    masked = torch.triu(torch.ones(lq, lk, dtype=torch.bool, device=q.device), diagonal=1)
    return torch.softmax(_scores(q, k, scale).masked_fill(masked, float("-inf")), dim=-1) @ v


# --- replacements ------------------------------------------------------------------------------------
def _sdpa(q, k, v, scale, mask=None, causal=False):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale).contiguous()


# --- checks ------------------------------------------------------------------------------------------
def _legal(match) -> str | None:
    tensors = match.tensor_inputs()
    q, k, v = tensors[:3]
    # mixed devices: one kernel reads every input from one device (SDPA runs on CPU and CUDA alike)
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        return f"inputs on several devices: {sorted(str(d) for d in devices)}"
    # float64 and integer q/k/v: the fused kernels take fp32/fp16/bf16
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {str(q.dtype).replace('torch.', '')} not supported (float32, float16, bfloat16)"
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


def _should(causal: bool):
    return lambda match, ctx: cost.estimate_attention(match, ctx, causal)


_QKV = [torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 8)]
register_pattern("attention", family="attention", kernel="sdpa", search=attention,
                 replacement=lambda q, k, v, scale: _sdpa(q, k, v, scale),
                 example_inputs=[*_QKV, SCALE], can_apply=_legal, should_apply=_should(False), priority=30)
register_pattern("attention_prescaled_q", family="attention", kernel="sdpa", search=attention_prescaled_q,
                 replacement=lambda q, k, v, scale: _sdpa(q, k, v, scale),
                 example_inputs=[*_QKV, SCALE], can_apply=_legal, should_apply=_should(False), priority=30)
register_pattern("attention_additive_mask", family="attention", kernel="sdpa", search=attention_additive_mask,
                 replacement=lambda q, k, v, mask, scale: _sdpa(q, k, v, scale, mask=mask.to(q.dtype)),
                 example_inputs=[*_QKV, torch.randn(2, 1, 5, 7), SCALE], can_apply=_mask_legal,
                 should_apply=_should(False), priority=40)
register_pattern("attention_bool_mask", family="attention", kernel="sdpa", search=attention_bool_mask,
                 replacement=lambda q, k, v, masked, scale: _sdpa(q, k, v, scale, mask=~masked),
                 example_inputs=[*_QKV, torch.rand(1, 1, 5, 7) > 0.5, SCALE], can_apply=_mask_legal,
                 should_apply=_should(False), priority=40)
register_pattern("attention_causal", family="attention", kernel="sdpa", search=attention_causal,
                 replacement=lambda q, k, v, scale: _sdpa(q, k, v, scale, causal=True),
                 example_inputs=[torch.randn(2, 3, 7, 8), *_QKV[1:], SCALE], can_apply=_legal,
                 should_apply=_should(True), priority=50)
