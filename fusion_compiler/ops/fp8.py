"""The FP8 linear (quantization in codegen/fp8.py, the GEMMs on torch._scaled_mm).

    fusion::fp8_linear(x [M, K], w [N, K], recipe, emulate, x_fp8=None, x_scale=None)
        -> y = x @ w^T [M, N] in x's dtype
    fusion::fp8_linear_backward(dy, x, w, recipe, emulate, needs) -> [dx, dw]
    fusion::fp8_quantize_rows(x [M, K], emulate) -> (x in e4m3, its scale per row [M, 1])

All three GEMMs of training run in FP8 with dynamic scales computed from the current tensors:
    y  = q(x) @ q(w)^T          scales per row of x and of w (rowwise) or per tensor (tensorwise)
    dx = q(dy) @ q(w^T)^T       w re-quantized along N, the new reduction dim
    dw = q(dy^T) @ q(x^T)^T     dy and x along M; or dy^T @ x in high precision (grad_weight_hp)
Recipes (RECIPES): "tensorwise" (e4m3 forward, e5m2 gradients), "rowwise" (e4m3 throughout) and
"rowwise_gw_hp" (rowwise with dW in x's dtype). `emulate` computes the same quantization (the same
scales, the same FP8 rounding: our kernels wherever Triton runs, the interpreter on CPU included, else
torch ops) and the products in fp32 from the dequantized operands: the math of the recipe on any
device, for CPU tests.
x_fp8 and x_scale: x already cast (per-row recipes: e4m3, a scale per row), by the kernel that produced
x (ops/norm.py's rms_norm_fp8, ops/elementwise.py's glu_fp8) or by one fp8_quantize_rows shared by the
linears that read x; the forward then skips its own cast of x (x itself is still saved for dW).
"""
import dataclasses
from typing import Optional

import torch
from torch import Tensor

from fusion_compiler._compat import scaled_mm
from fusion_compiler.codegen import fp8 as kernels
from fusion_compiler.codegen.launch import can_launch
from fusion_compiler.ops.define import fusion_op


@dataclasses.dataclass(frozen=True)
class Recipe:
    per_row: bool
    grad_dtype: torch.dtype  # of dy
    grad_weight_hp: bool  # dW = dy^T x in x's dtype


RECIPES = {
    "tensorwise": Recipe(False, torch.float8_e5m2, False),
    "rowwise": Recipe(True, torch.float8_e4m3fn, False),
    "rowwise_gw_hp": Recipe(True, torch.float8_e4m3fn, True),
}
E4M3 = torch.float8_e4m3fn


def recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"fp8 recipe {name!r}: expected one of {sorted(RECIPES)}")
    return RECIPES[name]


def _quantize(t: Tensor, dtype: torch.dtype, per_row: bool, emulate: bool):
    """Our kernel wherever Triton runs (emulation included: the interpreter on CPU), else torch's ops."""
    use_torch = emulate and can_launch(t.device) is not None
    return (kernels.quantize_reference if use_torch else kernels.quantize)(t, dtype, per_row)


def _gemm(a: Tensor, b: Tensor, a_dtype, b_dtype, per_row: bool, out_dtype: torch.dtype, emulate: bool,
          a_quantized: Optional[tuple] = None) -> Tensor:
    """a [M, K] @ b [N, K]^T, both quantized along K (their rows); a's (q, scale) when given."""
    qa, sa = a_quantized if a_quantized is not None else _quantize(a, a_dtype, per_row, emulate)
    qb, sb = _quantize(b, b_dtype, per_row, emulate)
    if emulate:
        return ((qa.float() * sa) @ (qb.float() * sb).t()).to(out_dtype)
    return scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb.t() if per_row else sb, out_dtype=out_dtype)


@fusion_op("fusion::fp8_linear")
def fp8_linear(x: Tensor, w: Tensor, recipe_name: str, emulate: bool, x_fp8: Optional[Tensor] = None,
               x_scale: Optional[Tensor] = None) -> Tensor:
    r = recipe(recipe_name)
    given = None
    if x_fp8 is not None:
        if not r.per_row or x_fp8.dtype != E4M3 or x_fp8.shape != x.shape or x_scale.shape != (x.shape[0], 1):
            raise ValueError(f"fp8_linear: a cast x must be e4m3 {tuple(x.shape)} with a scale per row "
                             f"(recipe {recipe_name}), got {x_fp8.dtype} {tuple(x_fp8.shape)}")
        given = (x_fp8, x_scale)
    return _gemm(x, w, E4M3, E4M3, r.per_row, x.dtype, emulate, given)


@fp8_linear.register_fake
def _(x, w, recipe_name, emulate, x_fp8=None, x_scale=None):
    return x.new_empty((x.shape[0], w.shape[0]))


@fusion_op("fusion::fp8_quantize_rows")
def fp8_quantize_rows(x: Tensor, emulate: bool) -> tuple[Tensor, Tensor]:
    return _quantize(x, E4M3, True, emulate)


def rows_fake(y: Tensor) -> tuple[Tensor, Tensor]:
    """The fake (q, scale) of y's e4m3 copy by rows, [rows, N] and [rows, 1]: what fp8_quantize_rows
    and the kernels that cast their own output (ops/norm.py, ops/elementwise.py) return."""
    rows = y.numel() // y.shape[-1]
    return y.new_empty((rows, y.shape[-1]), dtype=E4M3), y.new_empty((rows, 1), dtype=torch.float32)


@fp8_quantize_rows.register_fake
def _(x, emulate):
    return rows_fake(x)


def _no_grad_setup(ctx, inputs, output):
    ctx.mark_non_differentiable(*output)


fp8_quantize_rows.register_autograd(lambda ctx, dq, dscale: (None, None), setup_context=_no_grad_setup)


@fusion_op("fusion::fp8_linear_backward")
def fp8_linear_backward(dy: Tensor, x: Tensor, w: Tensor, recipe_name: str, emulate: bool,
                        needs: list[bool]) -> list[Tensor]:
    r = recipe(recipe_name)
    dx = dw = x.new_empty(0)
    if needs[0]:  # dx = dy @ w: w quantized along N
        dx = _gemm(dy, w.t(), r.grad_dtype, E4M3, r.per_row, x.dtype, emulate)
    if needs[1]:  # dW = dy^T @ x: both quantized along M
        dw = (dy.t() @ x).to(w.dtype) if r.grad_weight_hp else \
            _gemm(dy.t(), x.t(), r.grad_dtype, E4M3, r.per_row, w.dtype, emulate)
    return [dx, dw]


@fp8_linear_backward.register_fake
def _(dy, x, w, recipe_name, emulate, needs):
    return [x.new_empty(x.shape if needs[0] else (0,)), w.new_empty(w.shape if needs[1] else (0,))]


def _setup(ctx, inputs, output):
    x, w, recipe_name, emulate = inputs[:4]
    ctx.recipe, ctx.emulate = recipe_name, emulate
    ctx.save_for_backward(x, w)


def _grad(ctx, dy):
    x, w = ctx.saved_tensors
    needs = [ctx.needs_input_grad[0], ctx.needs_input_grad[1]]
    dx, dw = fp8_linear_backward(dy.contiguous(), x, w, ctx.recipe, ctx.emulate, needs)
    return (dx if needs[0] else None), (dw if needs[1] else None), None, None, None, None


fp8_linear.register_autograd(_grad, setup_context=_setup)
