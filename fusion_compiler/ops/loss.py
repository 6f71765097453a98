"""Loss ops whose forward also produces the gradient: cross-entropy (codegen/cross_entropy.py) and the
chunked linear + cross-entropy (codegen/linear_cross_entropy.py)."""
from typing import Optional

import torch
from torch import Tensor

from fusion_compiler.codegen import cross_entropy as ce_kernels
from fusion_compiler.codegen import linear_cross_entropy as lce_kernels
from fusion_compiler.ops.define import fusion_op


@fusion_op("fusion::cross_entropy")
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


@fusion_op("fusion::linear_cross_entropy")
def linear_cross_entropy(h: Tensor, w: Tensor, b: Optional[Tensor], target: Tensor, ignore_index: int,
                         reduction: str, label_smoothing: float, softcap: float,
                         with_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss, dh, dw, db) for cross_entropy(softcap(h @ w^T + b), target). Mean or sum: the gradients
    (for a unit incoming gradient) are computed in the forward only with_grad, else empty; they are
    the op's saved state, which the backward scales by the incoming gradient (use output 0).
    Reduction none (per-token losses): with_grad must be False; the backward runs the chunks again."""
    if reduction == "none" and with_grad:
        raise ValueError("fusion::linear_cross_entropy: reduction 'none' computes its gradients in the backward")
    loss, dh, dw, db = lce_kernels.linear_cross_entropy(h, w, b, target, ignore_index, reduction,
                                                        label_smoothing, softcap, with_grad)
    return loss, *(g if g is not None else h.new_empty(0) for g in (dh, dw, db))


@linear_cross_entropy.register_fake
def _(h, w, b, target, ignore_index, reduction, label_smoothing, softcap, with_grad):
    def grad(t):
        return t.new_empty(t.shape) if with_grad and t is not None else h.new_empty(0)
    shape = (h.shape[0],) if reduction == "none" else ()
    return h.new_empty(shape, dtype=torch.float32), grad(h), grad(w), grad(b)


@fusion_op("fusion::linear_cross_entropy_backward")
def linear_cross_entropy_backward(h: Tensor, w: Tensor, b: Optional[Tensor], target: Tensor, dloss: Tensor,
                                  ignore_index: int, label_smoothing: float,
                                  softcap: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dh, dw, db; db empty without a bias) of per-token losses with incoming gradient dloss (N,)."""
    _, dh, dw, db = lce_kernels.linear_cross_entropy(h, w, b, target, ignore_index, "none", label_smoothing,
                                                     softcap, True, row_grad=dloss.float())
    return dh, dw, db if db is not None else h.new_empty(0)


@linear_cross_entropy_backward.register_fake
def _(h, w, b, target, dloss, ignore_index, label_smoothing, softcap):
    return h.new_empty(h.shape), w.new_empty(w.shape), b.new_empty(b.shape) if b is not None else h.new_empty(0)


def _lce_setup(ctx, inputs, output):
    h, w, b, target, ignore_index, reduction, label_smoothing, softcap, _ = inputs
    ctx.with_bias, ctx.reduction = b is not None, reduction
    ctx.args = (ignore_index, label_smoothing, softcap)
    ctx.save_for_backward(*(output[1:] if reduction != "none" else (h, w, b, target)))
    ctx.mark_non_differentiable(*output[1:])


def _lce_grad(ctx, dloss, *_):
    """Mean / sum: the saved unit gradients times the incoming one. Out of place: in a compiled
    backward the saved tensors are donated buffers and Inductor writes the product over them (an
    in-place op on a saved tensor is functionalized into a copy instead: measured, no smaller and
    slower). None: the chunks again, each row scaled by its incoming gradient."""
    rest = (None,) * 6
    if ctx.reduction == "none":
        h, w, b, target = ctx.saved_tensors
        dh, dw, db = torch.ops.fusion.linear_cross_entropy_backward(h, w, b, target, dloss, *ctx.args)
        return dh, dw, (db if ctx.with_bias else None), *rest
    dh, dw, db = ctx.saved_tensors
    if dh.numel() == 0 and dw.numel() == 0:
        raise RuntimeError("fusion::linear_cross_entropy ran without with_grad: no gradient to give")
    scale = dloss.float()
    dh, dw = ((g * scale).to(g.dtype) for g in (dh, dw))
    return dh, dw, ((db * scale).to(db.dtype) if ctx.with_bias else None), *rest


linear_cross_entropy.register_autograd(_lce_grad, setup_context=_lce_setup)
