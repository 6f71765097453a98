"""Elementwise ops: rotary embedding and gated linear units (kernels in codegen/rope.py, glu.py).

The `_fp8` GLU variants also return y's e4m3 copy with a scale per row, written by the same kernel: the
input of the FP8 linear that reads y (patterns/fp8.py: the MLP's down projection), which then skips
its own cast of it. Their gradients are the plain GLU's.
"""
import torch
from torch import Tensor

from fusion_compiler.codegen import glu as glu_kernels
from fusion_compiler.codegen.launch import alloc
from fusion_compiler.codegen import rope as rope_kernels
from fusion_compiler.ops.define import fusion_op
from fusion_compiler.ops.fp8 import rows_fake


# --- RoPE ------------------------------------------------------------------------------------------
@fusion_op("fusion::rope")
def rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    return rope_kernels.rope(x, cos, sin, interleaved)


@rope.register_fake
def _(x, cos, sin, interleaved):
    return torch.empty_like(x)


@fusion_op("fusion::rope_backward")
def rope_backward(dy: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    return rope_kernels.rope(dy, cos, sin, interleaved, backward=True)


@rope_backward.register_fake
def _(dy, cos, sin, interleaved):
    return dy.new_empty(dy.shape)


def _rope_setup(ctx, inputs, output):
    x, cos, sin, interleaved = inputs
    ctx.interleaved = interleaved
    # x is needed only for the (rare) gradients of cos/sin
    ctx.save_for_backward(x if cos.requires_grad or sin.requires_grad else None, cos, sin)


def _rope_trig_grads(dy, x, interleaved):
    """d/dcos and d/dsin at full broadcast shape (rarely needed: cos/sin usually carry no grad)."""
    dy, x = dy.float(), x.float()
    if interleaved:
        dya, dyb, xa, xb = dy[..., 0::2], dy[..., 1::2], x[..., 0::2], x[..., 1::2]
        return dya * xa + dyb * xb, dyb * xa - dya * xb
    half = x.shape[-1] // 2
    return dy * x, dy * torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_grad(ctx, dy):
    x, cos, sin = ctx.saved_tensors
    dx = rope_backward(dy, cos, sin, ctx.interleaved) if ctx.needs_input_grad[0] else None
    dcos = dsin = None
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        gc, gs = _rope_trig_grads(dy, x, ctx.interleaved)
        dcos = gc.sum_to_size(cos.shape).to(cos.dtype)
        dsin = gs.sum_to_size(sin.shape).to(sin.dtype)
    return dx, dcos, dsin, None


rope.register_autograd(_rope_grad, setup_context=_rope_setup)


# --- GLU -------------------------------------------------------------------------------------------
@fusion_op("fusion::glu")
def glu(gate: Tensor, up: Tensor, act: str) -> Tensor:
    return glu_kernels.glu_fwd(gate, up, act)


@glu.register_fake
def _(gate, up, act):
    return gate.new_empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype))


@fusion_op("fusion::glu_backward")
def glu_backward(dy: Tensor, gate: Tensor, up: Tensor, act: str) -> tuple[Tensor, Tensor]:
    dgate, dup = glu_kernels.glu_bwd(dy, gate, up, act)
    return dgate.view(gate.shape), dup.view(up.shape)


@glu_backward.register_fake
def _(dy, gate, up, act):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


@fusion_op("fusion::glu_fp8")
def glu_fp8(gate: Tensor, up: Tensor, act: str) -> tuple[Tensor, Tensor, Tensor]:
    return glu_kernels.glu_fwd(gate, up, act, fp8_dtype=torch.float8_e4m3fn)


@glu_fp8.register_fake
def _(gate, up, act):
    return (glu(gate, up, act), *rows_fake(gate))


def _glu_setup(ctx, inputs, output):
    gate, up, act = inputs
    ctx.act = act
    ctx.save_for_backward(gate, up)
    if isinstance(output, tuple):  # the FP8 copy
        ctx.mark_non_differentiable(*output[1:])


def _glu_grad(ctx, dy, *_):
    gate, up = ctx.saved_tensors
    dgate, dup = glu_backward(dy, gate, up, ctx.act)
    return dgate, dup, None


for _op in (glu, glu_fp8):
    _op.register_autograd(_glu_grad, setup_context=_glu_setup)


def _halves(x: Tensor, gate_first: bool) -> tuple[Tensor, Tensor]:
    a, b = x.chunk(2, dim=-1)
    return (a, b) if gate_first else (b, a)


@fusion_op("fusion::glu_packed")
def glu_packed(x: Tensor, act: str, gate_first: bool) -> Tensor:
    gate, up = _halves(x, gate_first)
    return glu_kernels.glu_fwd(gate, up, act)


@glu_packed.register_fake
def _(x, act, gate_first):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@fusion_op("fusion::glu_packed_backward")
def glu_packed_backward(dy: Tensor, x: Tensor, act: str, gate_first: bool) -> Tensor:
    dx = alloc(x.shape, x.dtype, x.device)
    gate, up = _halves(x, gate_first)
    dgate, dup = _halves(dx.view(-1, x.shape[-1]), gate_first)
    glu_kernels.glu_bwd(dy, gate, up, act, dgate=dgate, dup=dup)
    return dx


@glu_packed_backward.register_fake
def _(dy, x, act, gate_first):
    return x.new_empty(x.shape)


@fusion_op("fusion::glu_packed_fp8")
def glu_packed_fp8(x: Tensor, act: str, gate_first: bool) -> tuple[Tensor, Tensor, Tensor]:
    gate, up = _halves(x, gate_first)
    return glu_kernels.glu_fwd(gate, up, act, fp8_dtype=torch.float8_e4m3fn)


@glu_packed_fp8.register_fake
def _(x, act, gate_first):
    y = glu_packed(x, act, gate_first)
    return (y, *rows_fake(y))


def _glu_packed_setup(ctx, inputs, output):
    x, act, gate_first = inputs
    ctx.act, ctx.gate_first = act, gate_first
    ctx.save_for_backward(x)
    if isinstance(output, tuple):  # the FP8 copy
        ctx.mark_non_differentiable(*output[1:])


def _glu_packed_grad(ctx, dy, *_):
    (x,) = ctx.saved_tensors
    return glu_packed_backward(dy, x, ctx.act, ctx.gate_first), None, None


for _op in (glu_packed, glu_packed_fp8):
    _op.register_autograd(_glu_packed_grad, setup_context=_glu_packed_setup)
