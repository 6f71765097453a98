"""Loss ops: cross-entropy whose forward also produces the gradient (kernel in codegen/cross_entropy.py)."""
import torch
from torch import Tensor

from fusion_compiler.codegen import cross_entropy as ce_kernels


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
