"""fusion::topk: the k largest entries of each row (an MoE router's expert scores) in one launch
(codegen/topk.py); the backward scatters the values' gradient into zeros, as aten.topk's does."""
import torch
from torch import Tensor

from fusion_compiler.codegen import topk as kernels
from fusion_compiler.ops.define import fusion_op


@fusion_op("fusion::topk")
def topk(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    why = kernels.supports(x, k)
    if why:
        raise ValueError(f"fusion::topk: {why}")
    return kernels.topk_rows(x, k)


@topk.register_fake
def _(x, k):
    shape = (*x.shape[:-1], k)
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.int64)


def _setup(ctx, inputs, output):
    x, _ = inputs
    ctx.shape = x.shape
    ctx.save_for_backward(output[1])


def _grad(ctx, grad_values, unused):
    (indices,) = ctx.saved_tensors
    grad = grad_values.new_zeros(ctx.shape).scatter_(-1, indices, grad_values)
    return grad, None


topk.register_autograd(_grad, setup_context=_setup)
