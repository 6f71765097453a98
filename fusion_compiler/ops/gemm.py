"""GEMM + generated epilogue ops (kernels in codegen/gemm.py).

    fusion::gemm_epilogue(epilogue, a, b, sides, shape, out_dtype, save_product) -> (y, z)
        y = epilogue(a @ b) viewed as `shape` (reduced over its last dim when the epilogue reduces);
        z = the product a @ b in `shape` when save_product (the backward reads it), else empty
    fusion::gemm_epilogue_backward(epilogue, grad, product, out, sides, shape, side_needs,
                                   product_dtype, a_shape, b_shape) -> [dz, d side 0, ...]
The autograd formula: dz from the generated backward kernel, then dA = dz B^T and dB = A^T dz as
torch matmuls (Inductor hands them to cuBLAS).
"""
import torch
from torch import Tensor

from fusion_compiler.codegen import gemm as kernels
from fusion_compiler.ops.define import fusion_op


@fusion_op("fusion::gemm_epilogue")
def gemm_epilogue(epilogue: str, a: Tensor, b: Tensor, sides: list[Tensor], shape: list[int],
                  out_dtype: torch.dtype, save_product: bool) -> tuple[Tensor, Tensor]:
    return kernels.forward(kernels.Epilogue.parse(epilogue), a, b, sides, shape, out_dtype, save_product)


@gemm_epilogue.register_fake
def _(epilogue, a, b, sides, shape, out_dtype, save_product):
    ep = kernels.Epilogue.parse(epilogue)
    return a.new_empty(kernels.reduced_shape(ep, shape), dtype=out_dtype), a.new_empty(shape if save_product else (0,))


@fusion_op("fusion::gemm_epilogue_backward")
def gemm_epilogue_backward(epilogue: str, grad: Tensor, product: Tensor, out: Tensor, sides: list[Tensor],
                           shape: list[int], side_needs: list[bool], product_dtype: torch.dtype,
                           a_shape: list[int], b_shape: list[int]) -> list[Tensor]:
    dz, grads = kernels.backward(kernels.Epilogue.parse(epilogue), grad, product, out, sides, shape, side_needs,
                                 product_dtype, a_shape, b_shape)
    return [dz] + [g if g is not None else s.new_empty(0) for s, g in zip(sides, grads)]


@gemm_epilogue_backward.register_fake
def _(epilogue, grad, product, out, sides, shape, side_needs, product_dtype, a_shape, b_shape):
    return [grad.new_empty(shape, dtype=product_dtype)] + [s.new_empty(s.shape if need else (0,))
                                                           for s, need in zip(sides, side_needs)]


def _setup(ctx, inputs, output):
    epilogue, a, b, sides, shape, out_dtype, save_product = inputs
    ep = kernels.Epilogue.parse(epilogue)
    ctx.epilogue, ctx.shape = epilogue, list(shape)
    ctx.side_needs = [s.requires_grad for s in sides]
    ctx.a_shape, ctx.b_shape = list(a.shape), list(b.shape)
    y, z = output
    out = y if ep.reduce == "logsumexp" else None
    ctx.save_for_backward(a, b, z, out, *sides)


def _product_grads(a: Tensor, b: Tensor, dz: Tensor, need_a: bool, need_b: bool):
    """dA = dz B^T and dB = A^T dz for the product's 2-D / 3-D forms."""
    n, k = b.shape[-1], a.shape[-1]
    if b.dim() == 2:
        dz2 = dz.reshape(-1, n)
        da = (dz2 @ b.t()).reshape(a.shape) if need_a else None
        db = a.reshape(-1, k).t() @ dz2 if need_b else None
        return da, db
    dz3 = dz.reshape(b.shape[0], -1, n)
    da = (dz3 @ b.transpose(-2, -1)).reshape(a.shape) if need_a else None
    db = a.transpose(-2, -1) @ dz3 if need_b else None
    return da, db


def _grad(ctx, dy, dz_unused):
    a, b, z, out, *sides = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    needs = ctx.side_needs
    if z.numel() == 0 and kernels.Epilogue.parse(ctx.epilogue).backward_reads_product(needs) and dy.numel():
        raise RuntimeError("fusion::gemm_epilogue: the backward needs the product, which the forward did not save "
                           "(save_product=False while a side input requires grad)")
    dz, *side_grads = gemm_epilogue_backward(ctx.epilogue, dy, z, out if out is not None else z.new_empty(0),
                                             sides, ctx.shape, needs, a.dtype, ctx.a_shape, ctx.b_shape)
    da, db = _product_grads(a, b, dz, need_a, need_b)
    grads = [g if need else None for g, need in zip(side_grads, needs)]
    return None, da, db, grads, None, None, None


gemm_epilogue.register_autograd(_grad, setup_context=_setup)
