"""fusion::embedding: the table lookup with ATen's own backward kept whole.

Inductor decomposes embedding_dense_backward into a scatter-add into an fp32 copy of the whole table
(for bf16/fp16 weights), then a cast: at the end of a Llama backward that is a (V, H) fp32 buffer
(1 GiB at 128K x 2048) next to its bf16 result. CUDA's kernel sorts the indices and sums the rows of
each index in fp32 partials the size of the tokens, then writes the table's gradient once in its own
dtype (deterministic too). The op hides that call from Inductor's decomposition."""
import torch
from torch import Tensor
from fusion_compiler.ops.define import fusion_op


@fusion_op("fusion::embedding")
def embedding(weight: Tensor, indices: Tensor, padding_idx: int) -> Tensor:
    return torch.ops.aten.embedding.default(weight, indices, padding_idx)


@embedding.register_fake
def _(weight, indices, padding_idx):
    return weight.new_empty((*indices.shape, weight.shape[1]))


@fusion_op("fusion::embedding_backward")
def embedding_backward(grad: Tensor, indices: Tensor, num_weights: int, padding_idx: int) -> Tensor:
    return torch.ops.aten.embedding_dense_backward.default(grad, indices, num_weights, padding_idx, False)


@embedding_backward.register_fake
def _(grad, indices, num_weights, padding_idx):
    return grad.new_empty((num_weights, grad.shape[-1]))


def _setup(ctx, inputs, output):
    weight, indices, padding_idx = inputs
    ctx.num_weights, ctx.padding_idx = weight.shape[0], padding_idx
    ctx.save_for_backward(indices)


def _grad(ctx, grad):
    (indices,) = ctx.saved_tensors
    return torch.ops.fusion.embedding_backward(grad.contiguous(), indices, ctx.num_weights, ctx.padding_idx), None, None


embedding.register_autograd(_grad, setup_context=_setup)
