"""fusion::multi_tensor_apply and fusion::multi_tensor_sum_squares: many tensors, one launch each.

    torch.ops.fusion.multi_tensor_apply(program, reads, writes, scalars)
        runs a lane program (codegen/multi_tensor.Program, as its text) over every lane: `reads` and
        `writes` are lane-major lists, `writes` are updated in place; scalars is [n_scalars, lanes]
    torch.ops.fusion.multi_tensor_sum_squares(tensors) -> fp32 [len(tensors)]
"""
import functools

import torch
from torch import Tensor

from fusion_compiler.codegen import multi_tensor
from fusion_compiler.ops.define import fusion_op


@functools.lru_cache(maxsize=256)
def _program(text: str) -> multi_tensor.Program:
    return multi_tensor.Program.parse(text)


@torch.library.custom_op("fusion::multi_tensor_apply", mutates_args=("writes",))
def multi_tensor_apply(program: str, reads: list[Tensor], writes: list[Tensor], scalars: Tensor) -> None:
    multi_tensor.apply(_program(program), reads, writes, scalars)


@multi_tensor_apply.register_fake
def _(program, reads, writes, scalars):
    return None


@fusion_op("fusion::multi_tensor_sum_squares")
def multi_tensor_sum_squares(tensors: list[Tensor]) -> Tensor:
    return multi_tensor.sum_squares(tensors)


@multi_tensor_sum_squares.register_fake
def _(tensors):
    return tensors[0].new_empty((len(tensors),), dtype=torch.float32)
