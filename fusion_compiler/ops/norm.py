"""Norm ops: RMSNorm, residual add + RMSNorm, LayerNorm (kernels in codegen/rmsnorm.py, layernorm.py)."""
from typing import Optional

import torch
from torch import Tensor

from fusion_compiler.codegen import layernorm, rmsnorm

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _rows(x: Tensor) -> int:
    return x.numel() // x.shape[-1]


# --- RMSNorm ---------------------------------------------------------------------------------------
@torch.library.custom_op("fusion::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    y, _, rstd = rmsnorm.rms_norm_fwd(x, weight, eps)
    return y, rstd


@rms_norm.register_fake
def _(x, weight, eps):
    y = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    return y, x.new_empty((_rows(x),), dtype=torch.float32)


@torch.library.custom_op("fusion::add_rms_norm", mutates_args=())
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    y, h, rstd = rmsnorm.rms_norm_fwd(x, weight, eps, residual=residual)
    return y, h, rstd


@add_rms_norm.register_fake
def _(x, residual, weight, eps):
    y = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    return y, x.new_empty(x.shape), x.new_empty((_rows(x),), dtype=torch.float32)


@torch.library.custom_op("fusion::rms_norm_backward", mutates_args=())
def rms_norm_backward(dy: Tensor, h: Tensor, weight: Tensor, rstd: Tensor, dh: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    return rmsnorm.rms_norm_bwd(dy, h, weight, rstd, dh_in=dh)


@rms_norm_backward.register_fake
def _(dy, h, weight, rstd, dh):
    return h.new_empty(h.shape), weight.new_empty(weight.shape)


def _rms_setup(ctx, inputs, output):
    x, weight = inputs[0], inputs[-2]
    ctx.residual_dtype = inputs[1].dtype if len(inputs) == 4 else None
    h = output[1] if len(inputs) == 4 else x
    ctx.save_for_backward(h, weight, output[-1])
    ctx.mark_non_differentiable(output[-1])


def _rms_norm_grad(ctx, dy, drstd):
    h, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_backward(dy, h, weight, rstd, None)
    return dx, dw, None


def _add_rms_norm_grad(ctx, dy, dh, drstd):
    h, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_backward(dy, h, weight, rstd, dh)
    return dx, dx.to(ctx.residual_dtype), dw, None


rms_norm.register_autograd(_rms_norm_grad, setup_context=_rms_setup)
add_rms_norm.register_autograd(_add_rms_norm_grad, setup_context=_rms_setup)


# --- LayerNorm -------------------------------------------------------------------------------------
@torch.library.custom_op("fusion::layer_norm", mutates_args=())
def layer_norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return layernorm.layer_norm_fwd(x, weight, bias, eps)


@layer_norm.register_fake
def _(x, weight, bias, eps):
    dtype = x.dtype
    for p in (weight, bias):
        if p is not None:
            dtype = torch.promote_types(dtype, p.dtype)
    stat = x.new_empty((_rows(x),), dtype=torch.float32)
    return x.new_empty(x.shape, dtype=dtype), stat, stat.new_empty(stat.shape)


@torch.library.custom_op("fusion::layer_norm_backward", mutates_args=())
def layer_norm_backward(dy: Tensor, x: Tensor, weight: Optional[Tensor], mean: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return layernorm.layer_norm_bwd(dy, x, weight, mean, rstd)


@layer_norm_backward.register_fake
def _(dy, x, weight, mean, rstd):
    n = x.shape[-1]
    return x.new_empty(x.shape), x.new_empty((n,), dtype=torch.float32), x.new_empty((n,), dtype=torch.float32)


def _ln_setup(ctx, inputs, output):
    x, weight, bias, _ = inputs
    ctx.save_for_backward(x, weight, output[1], output[2])
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.mark_non_differentiable(output[1], output[2])


def _ln_grad(ctx, dy, dmean, drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = layer_norm_backward(dy, x, weight, mean, rstd)
    dw = dw.to(weight.dtype) if weight is not None else None
    db = db.to(ctx.bias_dtype) if ctx.bias_dtype is not None else None
    return dx, dw, db, None


layer_norm.register_autograd(_ln_grad, setup_context=_ln_setup)
