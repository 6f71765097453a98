"""The FP8 linears (quantization in codegen/fp8.py, the GEMMs on torch._scaled_mm).

Per-row recipes ("rowwise": e4m3 throughout; "rowwise_gw_hp": the same with dW in x's dtype):
    fusion::fp8_linear(x [M, K], w [N, K], recipe, emulate, x_fp8=None, x_scale=None)
        -> y = x @ w^T [M, N] in x's dtype
    fusion::fp8_linear_backward(dy, x, w, recipe, emulate, needs) -> [dx, dw]
    fusion::fp8_quantize_rows(x [M, K], emulate) -> (x in e4m3, its scale per row [M, 1])
All three GEMMs of training run in FP8 with dynamic scales computed from the current tensors:
    y  = q(x) @ q(w)^T          scales per row of x and of w
    dx = q(dy) @ q(w^T)^T       w re-quantized along N, the new reduction dim
    dw = q(dy^T) @ q(x^T)^T     dy and x along M; or dy^T @ x in high precision (grad_weight_hp)
x_fp8 and x_scale: x already cast (e4m3, a scale per row), by the kernel that produced x (ops/norm.py's
rms_norm_fp8, ops/elementwise.py's glu_fp8) or by one fp8_quantize_rows shared by the linears that read
x; the forward then skips its own cast of x (x itself is still saved for dW).

The per-tensor recipe ("tensorwise": e4m3 forward, e5m2 gradients) scales a matrix and its transpose
alike, so each operand is cast once into both layouts and the backward reads only FP8:
    fusion::fp8_quantize_tensorwise(t [R, C], transposed, emulate)
        -> (q [R, C], q^T [C, R] (empty unless transposed), dequantization scale []), e4m3
    fusion::fp8_linear_tensorwise(x, w, qx, qx_t, x_scale, qw, qw_t, w_scale, emulate) -> y = q(x) @ q(w)^T
    fusion::fp8_linear_tensorwise_backward(dy, qx_t, x_scale, qw_t, w_scale, emulate, needs, w=None) -> [dx, dw]
        dy cast once (e5m2) into q(dy) and q(dy)^T: dx = q(dy) @ q(w), dw = q(dy)^T @ q(x)
x and w are operands of fp8_linear_tensorwise for their gradients only; it saves q(x)^T and q(w)^T
(FP8 bytes) for the backward, not x and w. An empty q(w)^T (the rewrite under prefer_memory) saves w
instead, and the backward casts it again: the same amax, so the same scale and bytes, without holding
one FP8 byte a weight element from the forward to the backward. `linear(x, w, recipe, emulate)` calls
either recipe's ops.

`emulate` computes the same quantization (the same scales, the same FP8 rounding: our kernels wherever
Triton runs, the interpreter on CPU included, else torch ops) and the products in fp32 from the
dequantized operands: the math of the recipe on any device, for CPU tests.
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


def torch_only(t: Tensor, emulate: bool) -> bool:
    """Emulating where Triton cannot run: torch's ops quantize (elsewhere our kernels, the interpreter
    on CPU included)."""
    return emulate and can_launch(t.device) is not None


def _quantize(t: Tensor, dtype: torch.dtype, emulate: bool):
    return (kernels.quantize_reference if torch_only(t, emulate) else kernels.quantize)(t, dtype)


def quantize_tensor(t: Tensor, dtype: torch.dtype, emulate: bool, rows: bool = True, transposed: bool = True):
    fn = kernels.quantize_tensorwise_reference if torch_only(t, emulate) else kernels.quantize_tensorwise
    return fn(t, dtype, rows, transposed)


def scaled(qa: Tensor, sa: Tensor, qb_t: Tensor, sb: Tensor, out_dtype: torch.dtype, emulate: bool) -> Tensor:
    """qa [M, K] @ qb_t [K, N] with their dequantization scales (per row of qa and per column of qb_t,
    or per tensor), in fp32 from the dequantized operands when emulating."""
    if emulate:
        return ((qa.float() * sa) @ (qb_t.float() * sb)).to(out_dtype)
    return scaled_mm(qa, qb_t, scale_a=sa, scale_b=sb, out_dtype=out_dtype)


def _gemm(a: Tensor, b: Tensor, a_dtype, b_dtype, out_dtype: torch.dtype, emulate: bool,
          a_quantized: Optional[tuple] = None) -> Tensor:
    """a [M, K] @ b [N, K]^T, both quantized by rows (along K); a's (q, scale) when given."""
    qa, sa = a_quantized if a_quantized is not None else _quantize(a, a_dtype, emulate)
    qb, sb = _quantize(b, b_dtype, emulate)
    return scaled(qa, sa, qb.t(), sb.t(), out_dtype, emulate)


@fusion_op("fusion::fp8_linear")
def fp8_linear(x: Tensor, w: Tensor, recipe_name: str, emulate: bool, x_fp8: Optional[Tensor] = None,
               x_scale: Optional[Tensor] = None) -> Tensor:
    r = recipe(recipe_name)
    if not r.per_row:
        raise ValueError(f"fp8_linear: recipe {recipe_name} runs as fusion::fp8_linear_tensorwise")
    given = None
    if x_fp8 is not None:
        if x_fp8.dtype != E4M3 or x_fp8.shape != x.shape or x_scale.shape != (x.shape[0], 1):
            raise ValueError(f"fp8_linear: a cast x must be e4m3 {tuple(x.shape)} with a scale per row "
                             f"(recipe {recipe_name}), got {x_fp8.dtype} {tuple(x_fp8.shape)}")
        given = (x_fp8, x_scale)
    return _gemm(x, w, E4M3, E4M3, x.dtype, emulate, given)


@fp8_linear.register_fake
def _(x, w, recipe_name, emulate, x_fp8=None, x_scale=None):
    return x.new_empty((x.shape[0], w.shape[0]))


@fusion_op("fusion::fp8_quantize_rows")
def fp8_quantize_rows(x: Tensor, emulate: bool) -> tuple[Tensor, Tensor]:
    return _quantize(x, E4M3, emulate)


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
        dx = _gemm(dy, w.t(), r.grad_dtype, E4M3, x.dtype, emulate)
    if needs[1]:  # dW = dy^T @ x: both quantized along M
        dw = (dy.t() @ x).to(w.dtype) if r.grad_weight_hp else \
            _gemm(dy.t(), x.t(), r.grad_dtype, E4M3, w.dtype, emulate)
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


@fusion_op("fusion::fp8_quantize_tensorwise")
def fp8_quantize_tensorwise(t: Tensor, transposed: bool, emulate: bool) -> tuple[Tensor, Tensor, Tensor]:
    q, qt, scale = quantize_tensor(t, E4M3, emulate, transposed=transposed)
    return q, qt if transposed else q.new_empty(0), scale


@fp8_quantize_tensorwise.register_fake
def _(t, transposed, emulate):
    rows, cols = t.shape
    return (t.new_empty((rows, cols), dtype=E4M3), t.new_empty((cols, rows) if transposed else (0,), dtype=E4M3),
            t.new_empty((), dtype=torch.float32))


fp8_quantize_tensorwise.register_autograd(lambda ctx, dq, dqt, dscale: (None, None, None),
                                          setup_context=_no_grad_setup)


@fusion_op("fusion::fp8_linear_tensorwise")
def fp8_linear_tensorwise(x: Tensor, w: Tensor, qx: Tensor, qx_t: Tensor, x_scale: Tensor, qw: Tensor,
                          qw_t: Tensor, w_scale: Tensor, emulate: bool) -> Tensor:
    if qx.shape != x.shape or qw.shape != w.shape or qx.dtype != E4M3 or qw.dtype != E4M3 or x_scale.dim() \
            or w_scale.dim():
        raise ValueError(f"fp8_linear_tensorwise: x {tuple(x.shape)} and w {tuple(w.shape)} need their e4m3 casts "
                         f"and a scale each, got {qx.dtype} {tuple(qx.shape)}, {qw.dtype} {tuple(qw.shape)}")
    return scaled(qx, x_scale, qw.t(), w_scale, x.dtype, emulate)


@fp8_linear_tensorwise.register_fake
def _(x, w, qx, qx_t, x_scale, qw, qw_t, w_scale, emulate):
    return x.new_empty((x.shape[0], w.shape[0]))


@fusion_op("fusion::fp8_linear_tensorwise_backward")
def fp8_linear_tensorwise_backward(dy: Tensor, qx_t: Tensor, x_scale: Tensor, qw_t: Tensor, w_scale: Tensor,
                                   emulate: bool, needs: list[bool], w: Optional[Tensor] = None) -> list[Tensor]:
    if not any(needs):
        return [dy.new_empty(0), dy.new_empty(0)]
    q, qt, scale = quantize_tensor(dy, recipe("tensorwise").grad_dtype, emulate, rows=needs[0], transposed=needs[1])
    return tensorwise_grads(dy, q, qt, scale, qx_t, x_scale, qw_t, w_scale, w, emulate, needs)


def tensorwise_grads(dy: Tensor, q: Optional[Tensor], qt: Optional[Tensor], scale: Tensor, qx_t: Tensor,
                     x_scale: Tensor, qw_t: Tensor, w_scale: Tensor, w: Optional[Tensor], emulate: bool,
                     needs: list[bool]) -> list[Tensor]:
    """[dx = q(dy) @ q(w), dW = q(dy)^T @ q(x)] (empty where not needed) in dy's dtype, from dy's cast
    (q, q^T, scale); w cast again where its transpose was not held (an empty qw_t)."""
    if needs[0] and qw_t.numel() == 0:
        if w is None:
            raise ValueError("tensorwise backward: dx needs q(w)^T or w")
        _, qw_t, w_scale = quantize_tensor(w, E4M3, emulate, rows=False)
    dx = scaled(q, scale, qw_t.t(), w_scale, dy.dtype, emulate) if needs[0] else dy.new_empty(0)
    dw = scaled(qt, scale, qx_t.t(), x_scale, dy.dtype, emulate) if needs[1] else dy.new_empty(0)
    return [dx, dw]


@fp8_linear_tensorwise_backward.register_fake
def _(dy, qx_t, x_scale, qw_t, w_scale, emulate, needs, w=None):
    m, n = dy.shape
    k = qw_t.shape[0] if qw_t.numel() or w is None else w.shape[1]
    return [dy.new_empty((m, k) if needs[0] else (0,)),
            dy.new_empty((n, qx_t.shape[0]) if needs[1] else (0,))]


def _tensorwise_setup(ctx, inputs, output):
    x, w, qx, qx_t, x_scale, qw, qw_t, w_scale, ctx.emulate = inputs
    ctx.save_for_backward(qx_t, x_scale, qw_t, w_scale, *([w] if qw_t.numel() == 0 else []))


def _tensorwise_grad(ctx, dy):
    qx_t, x_scale, qw_t, w_scale, *w = ctx.saved_tensors
    needs = [ctx.needs_input_grad[0], ctx.needs_input_grad[1]]
    dx, dw = fp8_linear_tensorwise_backward(dy.contiguous(), qx_t, x_scale, qw_t, w_scale, ctx.emulate, needs,
                                            *w)
    return (dx if needs[0] else None), (dw if needs[1] else None), None, None, None, None, None, None, None


fp8_linear_tensorwise.register_autograd(_tensorwise_grad, setup_context=_tensorwise_setup)


def linear(x: Tensor, w: Tensor, recipe_name: str, emulate: bool, hold_weight: bool = True) -> Tensor:
    """x [M, K] @ w [N, K]^T in FP8 under the recipe, as the FP8 rewrite emits it (tensorwise: each
    operand cast into both layouts, the transposes only where a gradient is wanted; w's only with
    hold_weight, else the backward casts w again)."""
    if recipe(recipe_name).per_row:
        return fp8_linear(x, w, recipe_name, emulate)
    grad = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)
    casts = [fp8_quantize_tensorwise(t.detach(), grad and held, emulate) for t, held in ((x, True), (w, hold_weight))]
    return fp8_linear_tensorwise(x, w, *casts[0], *casts[1], emulate)
