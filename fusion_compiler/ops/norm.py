"""Norm ops: RMSNorm, residual add + RMSNorm, LayerNorm (kernels in codegen/rmsnorm.py, layernorm.py).

The `_fp8` RMSNorm variants also return y's e4m3 copy with a scale per row, written by the same kernel:
the input of FP8 linears (patterns/fp8.py), which then skip their own cast of it.
"""
from typing import Optional

import torch
from torch import Tensor

from fusion_compiler.codegen import layernorm, rmsnorm
from fusion_compiler.ops.define import fusion_op
from fusion_compiler.ops.fp8 import rows_fake

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _rows(x: Tensor) -> int:
    return x.numel() // x.shape[-1]


# --- RMSNorm ---------------------------------------------------------------------------------------
@fusion_op("fusion::rms_norm")
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    y, _, rstd, _ = rmsnorm.rms_norm_fwd(x, weight, eps)
    return y, rstd


@rms_norm.register_fake
def _(x, weight, eps):
    y = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    return y, x.new_empty((_rows(x),), dtype=torch.float32)


@fusion_op("fusion::add_rms_norm")
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    y, h, rstd, _ = rmsnorm.rms_norm_fwd(x, weight, eps, residual=residual)
    return y, h, rstd


@add_rms_norm.register_fake
def _(x, residual, weight, eps):
    y = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    return y, x.new_empty(x.shape), x.new_empty((_rows(x),), dtype=torch.float32)


@fusion_op("fusion::rms_norm_backward")
def rms_norm_backward(dy: Tensor, h: Tensor, weight: Tensor, rstd: Tensor, dh: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    return rmsnorm.rms_norm_bwd(dy, h, weight, rstd, dh_in=dh)


@rms_norm_backward.register_fake
def _(dy, h, weight, rstd, dh):
    return h.new_empty(h.shape), weight.new_empty(weight.shape)


@fusion_op("fusion::rms_norm_fp8")
def rms_norm_fp8(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    y, _, rstd, (q, inv) = rmsnorm.rms_norm_fwd(x, weight, eps, fp8_dtype=torch.float8_e4m3fn)
    return y, rstd, q, inv


@rms_norm_fp8.register_fake
def _(x, weight, eps):
    return (*rms_norm(x, weight, eps), *rows_fake(x))


@fusion_op("fusion::add_rms_norm_fp8")
def add_rms_norm_fp8(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    y, h, rstd, (q, inv) = rmsnorm.rms_norm_fwd(x, weight, eps, residual=residual, fp8_dtype=torch.float8_e4m3fn)
    return y, h, rstd, q, inv


@add_rms_norm_fp8.register_fake
def _(x, residual, weight, eps):
    return (*add_rms_norm(x, residual, weight, eps), *rows_fake(x))


def _rms_setup(ctx, inputs, output):
    residual = len(inputs) == 4
    x, weight = inputs[0], inputs[-2]
    ctx.residual_dtype = inputs[1].dtype if residual else None
    h = output[1] if residual else x
    at = 2 if residual else 1  # rstd, then any FP8 copy
    ctx.save_for_backward(h, weight, output[at])
    ctx.mark_non_differentiable(*output[at:])


def _rms_norm_grad(ctx, dy, *_):
    h, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_backward(dy, h, weight, rstd, None)
    return dx, dw, None


def _add_rms_norm_grad(ctx, dy, dh, *_):
    h, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_backward(dy, h, weight, rstd, dh)
    return dx, dx.to(ctx.residual_dtype), dw, None


for _op in (rms_norm, rms_norm_fp8):
    _op.register_autograd(_rms_norm_grad, setup_context=_rms_setup)
for _op in (add_rms_norm, add_rms_norm_fp8):
    _op.register_autograd(_add_rms_norm_grad, setup_context=_rms_setup)


# --- LayerNorm -------------------------------------------------------------------------------------
@fusion_op("fusion::layer_norm")
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


@fusion_op("fusion::layer_norm_backward")
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
