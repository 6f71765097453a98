"""The routed-experts op (kernels in codegen/moe.py and codegen/moe_grouped_mm.py).

    fusion::moe_experts(x, index, weight, weights, layout, act, impl, scale_input=False)
                                                            -> (out, a1, a1_up, h, perm, offsets, xs)
        out[t] = sum_j weight[t, j] * expert_{index[t, j]}(x[t]) for x [T, D], index / weight [T, k]
        (scale_input: sum_j expert_{index[t, j]}(weight[t, j] * x[t]), torchtitan's score-before-experts);
        an expert is down(act(gate(x)) * up(x)) (gated) or down(act(up(x))).
        a1, a1_up, h, perm, offsets, xs are what the backward reads (pre-activations: a1 both halves,
        or on the grouped_mm path with gate and up weights apart the gate's, and a1_up the up's (else
        empty); activations (times the routing weight on the grouped_mm path unless scale_input), the
        gathered token rows on the grouped_mm path (empty on Triton's, which gathers in its kernels),
        the sort).
    fusion::moe_experts_backward(...) -> [dx, d weight, d weights...]

`weights` and `layout` say how the expert weights are stored, read in place:
    gate_up              [w_gate_up [E, 2F, D] (gate rows then up rows), w_down [E, D, F]]  (HF 5.x)
    gate_up_interleaved  the same with gate and up rows alternating
    separate             [w_gate [E, F, D], w_up [E, F, D], w_down [E, D, F]]
    up                   [w_up [E, F, D], w_down [E, D, F]]  (no gate)
and each with `_t` appended for weights stored transposed ([E, D, 2F], ..., [E, F, D]).
`impl` is "triton" (codegen/moe.py) or "grouped_mm"; where grouped_mm cannot run the operands
(`moe_grouped_mm.supports`: dtype, layout, strides; decided on shapes, so the fake agrees), Triton
runs instead.
"""
import torch
from torch import Tensor

from fusion_compiler.codegen import moe as kernels
from fusion_compiler.codegen import moe_grouped_mm
from fusion_compiler.ops.define import fusion_op

LAYOUTS = ("gate_up", "gate_up_interleaved", "separate", "up")
IMPLS = ("triton", "grouped_mm")


def parse_layout(layout: str) -> tuple[str, bool]:
    base, transposed = (layout[:-2], True) if layout.endswith("_t") else (layout, False)
    if base not in LAYOUTS:
        raise ValueError(f"fusion::moe_experts: unknown weight layout {layout!r} (one of {LAYOUTS}, optionally _t)")
    return base, transposed


def views(layout: str, weights: list[Tensor]) -> tuple[Tensor, Tensor | None, Tensor]:
    """(w_gate [E, F, D], w_up [E, F, D] or None, w_down [E, D, F]) as views of the stored weights."""
    base, transposed = parse_layout(layout)
    if len(weights) != (3 if base == "separate" else 2):
        raise ValueError(f"fusion::moe_experts: layout {layout!r} takes {3 if base == 'separate' else 2} "
                         f"weight tensors, got {len(weights)}")
    logical = [w.transpose(1, 2) for w in weights] if transposed else list(weights)
    if base == "separate":
        return tuple(logical)
    first, down = logical
    ffn = down.shape[2]
    if base == "up":
        return first, None, down
    if base == "gate_up":
        return first[:, :ffn], first[:, ffn:], down
    return first[:, 0::2], first[:, 1::2], down


def check(x: Tensor, index: Tensor, weight: Tensor, weights: list[Tensor], layout: str, act: str) -> None:
    """Raise a clear error for operands the op does not take."""
    w_gate, w_up, w_down = views(layout, weights)
    if act not in kernels.ACTIVATIONS:
        raise ValueError(f"fusion::moe_experts: activation {act!r} not in {sorted(kernels.ACTIVATIONS)}")
    if x.dim() != 2 or index.dim() != 2 or weight.shape != index.shape or index.shape[0] != x.shape[0]:
        raise ValueError(f"fusion::moe_experts: x [T, D], index and weight [T, k] expected, got {tuple(x.shape)}, "
                         f"{tuple(index.shape)}, {tuple(weight.shape)}")
    experts, ffn, width = w_gate.shape
    if x.shape[1] != width or w_down.shape != (experts, width, ffn) or (w_up is not None and w_up.shape != w_gate.shape):
        raise ValueError(f"fusion::moe_experts: weight shapes {[tuple(w.shape) for w in weights]} do not fit "
                         f"layout {layout!r} and width {x.shape[1]}")
    if any(w.dtype != x.dtype for w in weights) or index.is_floating_point():
        raise ValueError("fusion::moe_experts: expert weights must have x's dtype and index an integer dtype")


def _ups(layout: str, weights: list[Tensor]) -> list[Tensor]:
    """The first projection's weights as grouped_mm reads them, [E, N, D] each: [gate; up] in one tensor,
    gate and up apart, or up alone (one per stored weight but the last, the down projection)."""
    _, transposed = parse_layout(layout)
    return [w.transpose(1, 2) if transposed else w for w in weights[:-1]]


def resolve_impl(impl: str, x: Tensor, layout: str, weights: list[Tensor]) -> str:
    """The path that runs: "grouped_mm" when asked for and the operands allow it, else "triton"."""
    base, _ = parse_layout(layout)
    if impl == "grouped_mm" and base != "gate_up_interleaved":
        w_down = views(layout, weights)[2]
        if all(moe_grouped_mm.supports(x, up, w_down) is None for up in _ups(layout, weights)):
            return "grouped_mm"
    return "triton"


@fusion_op("fusion::moe_experts")
def moe_experts(x: Tensor, index: Tensor, weight: Tensor, weights: list[Tensor], layout: str, act: str, impl: str,
                scale_input: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    check(x, index, weight, weights, layout, act)
    w_gate, w_up, w_down = views(layout, weights)
    routing = kernels.route(index, weight, w_gate.shape[0])
    gated = w_up is not None
    path = resolve_impl(impl, x, layout, weights)
    if scale_input and path != "grouped_mm":
        raise ValueError("fusion::moe_experts: scale_input (routing weights on the experts' input) runs on the "
                         "grouped_mm path only: bf16 on CUDA, 16-byte aligned, gate and up not interleaved")
    if path == "grouped_mm":
        out, a1, a1_up, h, xs = moe_grouped_mm.forward(x, routing, _ups(layout, weights), w_down, act, gated,
                                                       scale_input)
    else:
        out, a1, h = kernels.forward(x, routing, w_gate, w_up, w_down, act, gated)
        a1_up, xs = None, x.new_empty(0)
    return out, a1, x.new_empty(0) if a1_up is None else a1_up, h, routing.perm, routing.offsets, xs


@moe_experts.register_fake
def _(x, index, weight, weights, layout, act, impl, scale_input=False):
    w_gate, w_up, w_down = views(layout, weights)
    rows, ffn = index.numel(), w_gate.shape[1]
    grouped = resolve_impl(impl, x, layout, weights) == "grouped_mm"
    apart = grouped and parse_layout(layout)[0] == "separate"
    a1 = x.new_empty((rows, 2 * ffn if w_up is not None and not apart else ffn))
    return (x.new_empty(x.shape), a1, x.new_empty((rows, ffn) if apart else (0,)),
            x.new_empty((rows, ffn)), index.new_empty((rows,), dtype=torch.int32),
            index.new_empty((w_gate.shape[0] + 1,), dtype=torch.int32),
            x.new_empty((rows, x.shape[1]) if grouped else (0,)))


@fusion_op("fusion::moe_experts_backward")
def moe_experts_backward(dout: Tensor, x: Tensor, weight: Tensor, weights: list[Tensor], a1: Tensor, a1_up: Tensor,
                         h: Tensor, perm: Tensor, offsets: Tensor, layout: str, act: str, impl: str,
                         needs: list[bool], scale_input: bool = False, xs: Tensor | None = None) -> list[Tensor]:
    """[dx, d weight, d weights...] (empty where `needs` (x, weight, each of weights) says no)."""
    w_gate, w_up, w_down = views(layout, weights)
    routing = kernels.rebuild(perm, offsets, weight)
    gated = w_up is not None
    if resolve_impl(impl, x, layout, weights) == "grouped_mm":
        dx, dweight, d_ups, d_down = moe_grouped_mm.backward(dout, x, routing, _ups(layout, weights), w_down, a1,
                                                              a1_up if a1_up.numel() else None, h, act, gated,
                                                              scale_input, tuple(needs), xs)
        transposed = parse_layout(layout)[1]
        dws = [None if d is None else (d.transpose(1, 2) if transposed else d) for d in (*d_ups, d_down)]
    else:
        dws = [torch.empty_like(w) if need else None for w, need in zip(weights, needs[2:])]
        outs = views(layout, [d if d is not None else w for d, w in zip(dws, weights)])
        dw_gate, dw_up, dw_down = [o if _wanted(layout, i, needs[2:]) else None for i, o in enumerate(outs)]
        dx, dweight = kernels.backward(dout, x, routing, w_gate, w_up, w_down, a1, h, act, gated,
                                       needs[0], needs[1], dw_gate, dw_up, dw_down)
    grads = [dx, None if dweight is None else dweight.to(weight.dtype)] + dws
    return [g if g is not None else x.new_empty(0) for g in grads]


def _wanted(layout: str, view_index: int, needs: list[bool]) -> bool:
    """Whether view view_index (0 gate, 1 up, 2 down) of `views` lies in a weight that needs a gradient."""
    base, _ = parse_layout(layout)
    stored = {"separate": (0, 1, 2), "up": (0, None, 1)}.get(base, (0, 0, 1))[view_index]
    return stored is not None and needs[stored]


@moe_experts_backward.register_fake
def _(dout, x, weight, weights, a1, a1_up, h, perm, offsets, layout, act, impl, needs, scale_input=False, xs=None):
    shapes = [x.shape, weight.shape] + [w.shape for w in weights]
    dtypes = [x.dtype, weight.dtype] + [w.dtype for w in weights]
    grads = [x.new_empty(s if need else (0,), dtype=d) for s, d, need in zip(shapes, dtypes, needs)]
    if parse_layout(layout)[1] and resolve_impl(impl, x, layout, weights) == "grouped_mm":
        # grouped_mm computes a transposed layout's weight gradients [E, N, K] and returns them transposed
        grads[2:] = [g.transpose(1, 2).contiguous().transpose(1, 2) if g.dim() == 3 else g for g in grads[2:]]
    return grads


def _setup(ctx, inputs, output):
    x, index, weight, weights, layout, act, impl, *rest = inputs
    out, a1, a1_up, h, perm, offsets, xs = output
    ctx.layout, ctx.act, ctx.impl, ctx.scale_input = layout, act, impl, bool(rest and rest[0])
    ctx.weight_needs = [w.requires_grad for w in weights]
    ctx.save_for_backward(x, weight, a1, a1_up, h, perm, offsets, xs, *weights)


def _grad(ctx, dout, *unused):
    x, weight, a1, a1_up, h, perm, offsets, xs, *weights = ctx.saved_tensors
    needs = [ctx.needs_input_grad[0], ctx.needs_input_grad[2]] + ctx.weight_needs
    grads = moe_experts_backward(dout, x, weight, weights, a1, a1_up, h, perm, offsets, ctx.layout, ctx.act, ctx.impl,
                                 needs, ctx.scale_input, xs)
    dx, dweight, *dws = [g if need else None for g, need in zip(grads, needs)]
    # layout, act, impl and scale_input get no gradient (one None per argument the caller passed)
    return (dx, None, dweight, dws) + (None,) * (len(ctx.needs_input_grad) - 4)


moe_experts.register_autograd(_grad, setup_context=_setup)
