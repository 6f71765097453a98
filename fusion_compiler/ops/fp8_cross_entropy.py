"""An FP8 LM head and the cross-entropy on its logits as one op (tensorwise recipe), so the logits'
gradient is born in FP8: the loss's backward kernel writes it in e5m2, both layouts, and the two
backward GEMMs read it (kernels: codegen/fp8_cross_entropy.py).

    fusion::fp8_linear_tensorwise_cross_entropy(x, w, <casts of x and w>, target, ignore_index,
                                                reduction, emulate)
        -> (logits = q(x) @ q(w)^T in x's dtype, loss fp32 (mean or sum over rows whose target is not
            ignore_index; a mean over no such row is 0), lse [N], amax [], count [])
    fusion::fp8_linear_tensorwise_cross_entropy_backward(dlogits, dloss, logits, lse, target, amax,
        count, qx_t, x_scale, qw_t, w_scale, ignore_index, reduction, emulate, needs, w=None) -> [dx, dw]

The same products as fusion::fp8_linear_tensorwise followed by cross-entropy on the logits (upcast to
fp32): dx = q(d) @ q(w), dW = q(d)^T @ q(x) with d = dloss * (softmax - onehot) (/ count) + dlogits.
The logits are an output (HF returns them); their own incoming gradient is added in the same kernel
(read only when not all zero). The difference from the two ops apart: q(d) is cast from fp32, not from
d rounded to the logits' dtype first, and its scale comes from the forward's exact amax of
softmax - onehot (a bound where dlogits is not zero). lse, amax and count are saved for the backward.
"""
from typing import Optional

import torch
from torch import Tensor

from fusion_compiler.codegen import cross_entropy as ce_kernels
from fusion_compiler.codegen import fp8_cross_entropy as kernels
from fusion_compiler.ops.define import fusion_op
from fusion_compiler.ops.fp8 import E4M3, recipe, scaled, tensorwise_grads, torch_only

REDUCTIONS = ("mean", "sum")


def _check(x: Tensor, w: Tensor, qx: Tensor, qw: Tensor, target: Tensor, reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"fp8_linear_tensorwise_cross_entropy: reduction {reduction!r}, expected one of {REDUCTIONS}")
    if qx.shape != x.shape or qw.shape != w.shape or qx.dtype != E4M3 or qw.dtype != E4M3:
        raise ValueError(f"fp8_linear_tensorwise_cross_entropy: x {tuple(x.shape)} and w {tuple(w.shape)} need their "
                         f"e4m3 casts, got {qx.dtype} {tuple(qx.shape)}, {qw.dtype} {tuple(qw.shape)}")
    if target.dim() != 1 or target.shape[0] != x.shape[0] or target.dtype != torch.int64:
        raise ValueError(f"fp8_linear_tensorwise_cross_entropy: target {target.dtype}{list(target.shape)} is not "
                         f"int64 ({x.shape[0]},)")


@fusion_op("fusion::fp8_linear_tensorwise_cross_entropy")
def fp8_linear_tensorwise_cross_entropy(x: Tensor, w: Tensor, qx: Tensor, qx_t: Tensor, x_scale: Tensor, qw: Tensor,
                                        qw_t: Tensor, w_scale: Tensor, target: Tensor, ignore_index: int,
                                        reduction: str, emulate: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    _check(x, w, qx, qw, target, reduction)
    logits = scaled(qx, x_scale, qw.t(), w_scale, x.dtype, emulate)
    stats = kernels.stats_reference if torch_only(logits, emulate) else kernels.stats
    losses, lse, amax = stats(logits, target, ignore_index)
    count, _ = ce_kernels.loss_scale(target, ignore_index, reduction)
    return logits, ce_kernels.reduce(losses, count, reduction), lse, amax, count


@fp8_linear_tensorwise_cross_entropy.register_fake
def _(x, w, qx, qx_t, x_scale, qw, qw_t, w_scale, target, ignore_index, reduction, emulate):
    _check(x, w, qx, qw, target, reduction)
    f32 = torch.float32
    return (x.new_empty((x.shape[0], w.shape[0])), x.new_empty((), dtype=f32), x.new_empty((x.shape[0],), dtype=f32),
            x.new_empty((), dtype=f32), x.new_empty((), dtype=f32))


@fusion_op("fusion::fp8_linear_tensorwise_cross_entropy_backward")
def fp8_linear_tensorwise_cross_entropy_backward(
        dlogits: Optional[Tensor], dloss: Tensor, logits: Tensor, lse: Tensor, target: Tensor, amax: Tensor,
        count: Tensor, qx_t: Tensor, x_scale: Tensor, qw_t: Tensor, w_scale: Tensor, ignore_index: int,
        reduction: str, emulate: bool, needs: list[bool], w: Optional[Tensor] = None) -> list[Tensor]:
    if not any(needs):
        return [logits.new_empty(0), logits.new_empty(0)]
    cast = kernels.grad_cast_reference if torch_only(logits, emulate) else kernels.grad_cast
    q, qt, scale = cast(logits, lse, target, dlogits, dloss, count, amax, ignore_index, reduction == "mean",
                        recipe("tensorwise").grad_dtype, rows=needs[0], transposed=needs[1])
    return tensorwise_grads(logits, q, qt, scale, qx_t, x_scale, qw_t, w_scale, w, emulate, needs)


@fp8_linear_tensorwise_cross_entropy_backward.register_fake
def _(dlogits, dloss, logits, lse, target, amax, count, qx_t, x_scale, qw_t, w_scale, ignore_index, reduction,
      emulate, needs, w=None):
    m, n = logits.shape
    k = qw_t.shape[0] if qw_t.numel() or w is None else w.shape[1]
    return [logits.new_empty((m, k) if needs[0] else (0,)),
            logits.new_empty((n, qx_t.shape[0]) if needs[1] else (0,))]


def _setup(ctx, inputs, output):
    x, w, qx, qx_t, x_scale, qw, qw_t, w_scale, target, ctx.ignore_index, ctx.reduction, ctx.emulate = inputs
    logits, _, lse, amax, count = output
    ctx.mark_non_differentiable(lse, amax, count)
    ctx.set_materialize_grads(False)  # logits nobody differentiates: None, not a tensor of zeros to fill and read
    ctx.save_for_backward(logits, lse, target, amax, count, qx_t, x_scale, qw_t, w_scale,
                          *([w] if qw_t.numel() == 0 else []))


def _grad(ctx, dlogits, dloss, _lse, _amax, _count):
    logits, lse, target, amax, count, qx_t, x_scale, qw_t, w_scale, *w = ctx.saved_tensors
    needs = [ctx.needs_input_grad[0], ctx.needs_input_grad[1]]
    if dloss is None:  # only the logits were differentiated
        dloss = amax.new_zeros(())
    dx, dw = fp8_linear_tensorwise_cross_entropy_backward(
        dlogits, dloss, logits, lse, target, amax, count, qx_t, x_scale, qw_t, w_scale, ctx.ignore_index,
        ctx.reduction, ctx.emulate, needs, *w)
    return (dx if needs[0] else None), (dw if needs[1] else None), *([None] * 10)


fp8_linear_tensorwise_cross_entropy.register_autograd(_grad, setup_context=_setup)
