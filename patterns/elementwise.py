"""Elementwise family: rotary embeddings and gated linear units.

RoPE, per tensor (q and k are two regions):
    HF rotate_half        x * cos + cat((-x2, x1), -1) * sin         (x1, x2 = the halves of x)
    complex / interleaved view_as_real(view_as_complex(x.float().reshape(..., -1, 2)) * freqs)
                          .flatten(-2).type_as(x)                    (Meta Llama, torchtitan)
GLU, act in silu / gelu / gelu(tanh):
    separate halves       act(gate) * up                  (HF LlamaMLP: gate_proj and up_proj)
    packed                gate, up = x.chunk(2, -1); act(gate) * up    (fused gate/up projection)
                          x, gate = h.chunk(2, -1); x * act(gate)      (diffusers-style GeGLU)
"""
import functools

import torch
import torch.nn.functional as F

from fusion_compiler.codegen.rope import rope_check
from fusion_compiler.pattern import register_pattern

from .checks import kernel_inputs


# --- RoPE ------------------------------------------------------------------------------------------------
def rope_rotate_half(x, cos, sin):
    """before: x * cos + rotate_half(x) * sin     after: fusion.rope(x, cos, sin, interleaved=False)"""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _rope_half_legal(match) -> str | None:
    x, cos, sin = match.input_values()
    why = kernel_inputs(match) or rope_check(x, cos, sin, interleaved=False)
    if why:
        return why
    # cos/sin of a wider dtype would promote the result; the kernel writes x's dtype
    if torch.promote_types(x.dtype, torch.promote_types(cos.dtype, sin.dtype)) != x.dtype:
        return f"cos/sin ({cos.dtype}) would promote x ({x.dtype})"
    return None


register_pattern("rope_rotate_half", family="elementwise", kernel="rope", search=rope_rotate_half,
                 replacement=lambda x, cos, sin: torch.ops.fusion.rope(x, cos, sin, False),
                 example_inputs=[torch.randn(2, 3, 5, 8), torch.randn(2, 1, 5, 8), torch.randn(2, 1, 5, 8)],
                 can_apply=_rope_half_legal, priority=5)


def rope_complex(x, freqs):
    """before: view_as_real(view_as_complex(x.float().reshape(.., -1, 2)) * freqs).flatten(-2).type_as(x)
    after:  fusion.rope(x, freqs.real, freqs.imag, interleaved=True)"""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs).flatten(-2).type_as(x)


def _rope_complex_replacement(x, freqs):
    f = torch.view_as_real(freqs)
    return torch.ops.fusion.rope(x, f[..., 0], f[..., 1], True)


def _rope_complex_legal(match) -> str | None:
    x, freqs = match.input_values()
    why = kernel_inputs(match, complex_ok=True)
    if why:
        return why
    # complex128 frequencies would compute in double precision
    if freqs.dtype != torch.complex64:
        return f"freqs dtype {freqs.dtype} (complex64 supported)"
    real = torch.empty(freqs.shape, dtype=torch.float32, device="meta")
    return rope_check(torch.empty(x.shape, device="meta"), real, real, interleaved=True)


register_pattern("rope_complex", family="elementwise", kernel="rope", search=rope_complex,
                 replacement=_rope_complex_replacement,
                 example_inputs=[torch.randn(2, 5, 3, 8), torch.randn(1, 5, 1, 4, dtype=torch.complex64)],
                 can_apply=_rope_complex_legal, priority=5)


# --- GLU -------------------------------------------------------------------------------------------------
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


def _glu_legal(match) -> str | None:
    gate, up = match.input_values()
    why = kernel_inputs(match)
    if why:
        return why
    # act(gate) * up with broadcasting is not a GLU
    if gate.shape != up.shape:
        return f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape"
    return None


def _glu_packed_legal(match) -> str | None:
    (x,) = match.input_values()
    return kernel_inputs(match)


def _register_glu(act: str) -> None:
    fn = ACTIVATIONS[act]

    def glu(gate, up):
        return fn(gate) * up

    def glu_packed(x):
        gate, up = x.chunk(2, dim=-1)
        return fn(gate) * up

    def glu_packed_up_first(x):
        up, gate = x.chunk(2, dim=-1)
        return up * fn(gate)

    glu.__doc__ = f"before: {act}(gate) * up     after: fusion.glu(gate, up, {act!r})"
    glu_packed.__doc__ = f"before: gate, up = x.chunk(2, -1); {act}(gate) * up    after: fusion.glu_packed(x)"
    glu_packed_up_first.__doc__ = f"before: up, gate = x.chunk(2, -1); up * {act}(gate)    after: fusion.glu_packed(x)"
    register_pattern(f"glu_{act}", family="elementwise", kernel="glu", search=glu,
                     replacement=lambda g, u: torch.ops.fusion.glu(g, u, act),
                     example_inputs=[torch.randn(4, 16), torch.randn(4, 16)], can_apply=_glu_legal, priority=5,
                     fp8_producer=True)
    register_pattern(f"glu_{act}_packed", family="elementwise", kernel="glu_packed", search=glu_packed,
                     replacement=lambda x: torch.ops.fusion.glu_packed(x, act, True),
                     example_inputs=[torch.randn(4, 32)], can_apply=_glu_packed_legal, priority=10,
                     fp8_producer=True)
    register_pattern(f"glu_{act}_packed_up_first", family="elementwise", kernel="glu_packed",
                     search=glu_packed_up_first, replacement=lambda x: torch.ops.fusion.glu_packed(x, act, False),
                     example_inputs=[torch.randn(4, 32)], can_apply=_glu_packed_legal, priority=10,
                     fp8_producer=True)


for _act in ACTIVATIONS:
    _register_glu(_act)
