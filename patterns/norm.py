"""Norm family: RMSNorm, residual add + RMSNorm, LayerNorm.

Spellings matched (one canonical form each, see canonical.py):
    HF LlamaRMSNorm      w * (x.float() * rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(dt)
    torch.nn.RMSNorm     F.rms_norm(x, (n,), w, eps)     (fused ATen op on CUDA: decomposed first)
    hand-written         x * torch.rsqrt(torch.mean(x * x, -1, keepdim=True) + eps) * w
    Gemma's (1 + w)      the weight wildcard binds the (1 + w) node
    LayerNorm            nn.LayerNorm / F.layer_norm, with or without bias
"""
import torch
import torch.nn.functional as F

from fusion_compiler.pattern import register_pattern

from .checks import kernel_inputs, row_width

EPS = 1.2345e-5  # distinctive example value: the traced literal equal to it binds `eps`


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


# --- RMSNorm -------------------------------------------------------------------------------------------
def rms_norm(x, weight, eps):
    """before: x * rsqrt(mean(x^2, -1) + eps) * weight     after: fusion.rms_norm(x, weight, eps)"""
    return _rms(x, weight, eps)


def _rms_norm_replacement(x, weight, eps):
    return torch.ops.fusion.rms_norm(x, weight, eps)[0]


def _rms_norm_legal(match) -> str | None:
    values = match.input_values()
    x, weight = values[0], values[-2]
    why = kernel_inputs(match) or row_width(x.shape[-1])
    if why:
        return why
    # weight broadcast other than one value per column
    if tuple(weight.shape) != (x.shape[-1],):
        return f"weight of shape {tuple(weight.shape)} is not ({x.shape[-1]},)"
    return None


register_pattern("rms_norm", family="norm", search=rms_norm, replacement=_rms_norm_replacement,
                 example_inputs=[torch.randn(4, 16), torch.randn(16), EPS],
                 can_apply=_rms_norm_legal, priority=10, fp8_producer=True)


# --- residual add + RMSNorm ------------------------------------------------------------------------------
def add_rms_norm(x, residual, weight, eps):
    """before: h = x + residual; y = rms_norm(h)   after: y, h = fusion.add_rms_norm(...)[:2]"""
    h = x + residual
    return _rms(h, weight, eps), h


def _add_rms_norm_replacement(x, residual, weight, eps):
    y, h, _ = torch.ops.fusion.add_rms_norm(x, residual, weight, eps)
    return y, h


def _add_rms_norm_legal(match) -> str | None:
    x, residual = match.input_values()[:2]
    # the residual add must not broadcast, and both operands share a dtype (h is written in it)
    if x.shape != residual.shape or x.dtype != residual.dtype:
        return f"residual {tuple(residual.shape)}/{residual.dtype} differs from x {tuple(x.shape)}/{x.dtype}"
    return _rms_norm_legal(match)


register_pattern("add_rms_norm", family="norm", search=add_rms_norm, replacement=_add_rms_norm_replacement,
                 example_inputs=[torch.randn(4, 16), torch.randn(4, 16), torch.randn(16), EPS],
                 can_apply=_add_rms_norm_legal, priority=20, fp8_producer=True)


# --- LayerNorm -------------------------------------------------------------------------------------------
def layer_norm(x, weight, bias, eps):
    """before: F.layer_norm(x, (n,), weight, bias, eps)   after: fusion.layer_norm(x, weight, bias, eps)"""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def layer_norm_no_bias(x, weight, eps):
    """before: F.layer_norm(x, (n,), weight, None, eps)   after: fusion.layer_norm(x, weight, None, eps)"""
    return F.layer_norm(x, (x.shape[-1],), weight, None, eps)


def _layer_norm_legal(match) -> str | None:
    x, *params = [v for v in match.input_values() if isinstance(v, torch.Tensor)]
    why = kernel_inputs(match) or row_width(x.shape[-1])
    if why:
        return why
    # parameters other than one value per column
    for p in params:
        if tuple(p.shape) != (x.shape[-1],):
            return f"parameter of shape {tuple(p.shape)} is not ({x.shape[-1]},)"
    return None


register_pattern("layer_norm", family="norm", search=layer_norm,
                 replacement=lambda x, w, b, eps: torch.ops.fusion.layer_norm(x, w, b, eps)[0],
                 example_inputs=[torch.randn(4, 16), torch.randn(16), torch.randn(16), EPS],
                 can_apply=_layer_norm_legal, priority=10)
register_pattern("layer_norm_no_bias", family="norm", search=layer_norm_no_bias, kernel="layer_norm",
                 replacement=lambda x, w, eps: torch.ops.fusion.layer_norm(x, w, None, eps)[0],
                 example_inputs=[torch.randn(4, 16), torch.randn(16), EPS],
                 can_apply=_layer_norm_legal, priority=10)
