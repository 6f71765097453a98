"""Loss ops whose forward also produces the gradient: cross-entropy (codegen/cross_entropy.py) and the
chunked linear + cross-entropy (codegen/linear_cross_entropy.py)."""
from typing import Optional

import torch
from torch import Tensor

from fusion_compiler.codegen import cross_entropy as ce_kernels
from fusion_compiler.codegen import linear_cross_entropy as lce_kernels


@torch.library.custom_op("fusion::cross_entropy", mutates_args=())
def cross_entropy(logits: Tensor, target: Tensor, ignore_index: int, reduction: str,
                  label_smoothing: float) -> tuple[Tensor, Tensor]:
    # the loss stays in fp32 (how it is accumulated); the engine casts it to the region's dtype when
    # that is lower, and HF's upcast spelling keeps it fp32
    return ce_kernels.cross_entropy(logits, target, ignore_index, reduction, label_smoothing)


@cross_entropy.register_fake
def _(logits, target, ignore_index, reduction, label_smoothing):
    shape = (logits.shape[0],) if reduction == "none" else ()
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(logits.shape)


def _setup(ctx, inputs, output):
    ctx.reduction = inputs[3]
    ctx.save_for_backward(output[1])
    ctx.mark_non_differentiable(output[1])


def _grad(ctx, dloss, _ddlogits):
    (dlogits,) = ctx.saved_tensors
    scale = dloss[:, None] if ctx.reduction == "none" else dloss
    return (dlogits * scale.float()).to(dlogits.dtype), None, None, None, None


cross_entropy.register_autograd(_grad, setup_context=_setup)


@torch.library.custom_op("fusion::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(h: Tensor, w: Tensor, b: Optional[Tensor], target: Tensor, ignore_index: int,
                         reduction: str, label_smoothing: float, softcap: float,
                         with_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss, dh, dw, db) for cross_entropy(softcap(h @ w^T + b), target) with reduction mean or sum;
    the gradients (for a unit incoming gradient) are computed only with_grad, else empty. They are
    the op's saved state: the backward scales them in place by the incoming gradient and hands them
    on as the input gradients (use output 0)."""
    loss, dh, dw, db = lce_kernels.linear_cross_entropy(h, w, b, target, ignore_index, reduction,
                                                        label_smoothing, softcap, with_grad)
    return loss, *(g if g is not None else h.new_empty(0) for g in (dh, dw, db))


@linear_cross_entropy.register_fake
def _(h, w, b, target, ignore_index, reduction, label_smoothing, softcap, with_grad):
    def grad(t):
        return t.new_empty(t.shape) if with_grad and t is not None else h.new_empty(0)
    return h.new_empty((), dtype=torch.float32), grad(h), grad(w), grad(b)


def _lce_setup(ctx, inputs, output):
    ctx.with_bias = inputs[2] is not None
    ctx.save_for_backward(*output[1:])
    ctx.mark_non_differentiable(*output[1:])


def _lce_grad(ctx, dloss, *_):
    """The saved unit gradients times the incoming one. Out of place: in a compiled backward the
    saved tensors are donated buffers and Inductor writes the product over them (an in-place op on
    a saved tensor is functionalized into a copy instead: measured, no smaller and slower)."""
    dh, dw, db = ctx.saved_tensors
    if dh.numel() == 0 and dw.numel() == 0:
        raise RuntimeError("fusion::linear_cross_entropy ran without with_grad: no gradient to give")
    scale = dloss.float()
    dh, dw = ((g * scale).to(g.dtype) for g in (dh, dw))
    return dh, dw, ((db * scale).to(db.dtype) if ctx.with_bias else None), None, None, None, None, None, None


linear_cross_entropy.register_autograd(_lce_grad, setup_context=_lce_setup)
