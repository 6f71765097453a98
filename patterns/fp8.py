"""FP8 family (opt-in, FusionConfig(fp8=recipe)): linears become FP8 GEMMs where the cost model says
they pay.

    before:  y = F.linear(x, w)                              (mm(x, w.t()), 2-D after F.linear's view)
    after:   y = fusion.fp8_linear(x, w, recipe, emulate)     (forward, dx and dW in FP8: ops/fp8.py)

Per GEMM, `cost.estimate_fp8_linear` weighs the FP8 GEMMs (at the card's measured FP8 rate, with
their tile waves) plus the quantization passes (each operand read once and written in FP8, both
layouts in training) against the high-precision GEMMs on cuBLAS; small or skinny products, where
the passes cost more than the faster GEMM saves, keep their dtype and the row says why.
Legal: a CUDA GPU of compute capability >= 8.9 (or FusionConfig(fp8_emulate=True), which computes
the recipe's rounding in higher precision on any device), fp32/bf16/fp16 operands of one dtype,
static sizes that are multiples of 16 (torch._scaled_mm's), bf16 for the rowwise recipes (their
scaled GEMM returns bf16 only). Linears with a bias (addmm) are left alone.

Runs after the library's patterns (the LM head + loss, attention take their products first) and
before the GEMM epilogue pass.
"""
import types

import torch
import torch.fx as fx

from fusion_compiler import cost
from fusion_compiler.canonical import val
from fusion_compiler.decisions import Decision, describe, location
from fusion_compiler.ops import fp8 as fp8_op
from fusion_compiler.patterns.checks import float_dtype, one_device
from fusion_compiler.patterns.gemm_horizontal import linear_operands

DESCRIPTOR = types.SimpleNamespace(name="fp8_linear", family="fp8")
KERNEL = "fusion::fp8_linear"
MIN_CAPABILITY = (8, 9)
aten = torch.ops.aten


def _hardware(device: torch.device, emulate: bool) -> str | None:
    if emulate:
        return None
    if device.type != "cuda":
        return (f"FP8 GEMMs need a CUDA GPU of compute capability >= 8.9, not {device.type} "
                "(FusionConfig(fp8_emulate=True) emulates the recipe)")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return f"FP8 GEMMs need compute capability >= 8.9, this GPU has {capability[0]}.{capability[1]}"
    return None


def _legal(x: torch.Tensor, w: torch.Tensor, recipe: str, emulate: bool) -> str | None:
    why = one_device([x, w]) or float_dtype(x) or _hardware(x.device, emulate)
    if why:
        return why
    if w.dtype != x.dtype:
        return f"weight {w.dtype} and input {x.dtype} differ"
    if fp8_op.recipe(recipe).per_row and x.dtype != torch.bfloat16:
        return f"recipe {recipe}: torch._scaled_mm's per-row scaling returns bfloat16 only, the linear is {x.dtype}"
    sizes = (*x.shape, w.shape[0])
    if any(isinstance(s, torch.SymInt) for s in sizes):
        return "symbolic (dynamic) sizes"
    if any(s % 16 for s in sizes):
        return f"M, K, N = {sizes[0]}, {sizes[1]}, {sizes[2]}: torch._scaled_mm needs multiples of 16"
    return None


def _row(gid, node, verdict, reason, inputs, estimate=None) -> Decision:
    return Decision(gid, DESCRIPTOR.name, DESCRIPTOR.family, verdict, reason, location(node),
                    tuple(describe(v) for v in inputs),
                    bytes_saved=estimate.bytes_saved if estimate else None,
                    time_saved_us=round(estimate.time_saved_s * 1e6, 2) if estimate else None, kernel=KERNEL)


def rewrite(gm: fx.GraphModule, config, log, gid: int, needs_grad: set) -> int:
    """Rewrite every bias-free linear that is legal and pays; one decision row each."""
    if config.fp8 is None or not config.enables(DESCRIPTOR):
        return 0
    recipe = fp8_op.recipe(config.fp8)
    applied = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.mm.default:
            continue
        found = linear_operands(node)
        if found is None:
            continue
        a, w, _ = found
        x_val, w_val = val(a), val(w)
        why = _legal(x_val, w_val, config.fp8, config.fp8_emulate)
        if why:
            log.add(_row(gid, node, "rejected", why, [x_val, w_val]))
            continue
        training = node in needs_grad
        ctx = cost.CostContext(cost.profile_for(x_val.device, config.device_profile), config.baseline, training,
                               config.prefer_memory)
        estimate = cost.estimate_fp8_linear(x_val.shape[0], w_val.shape[0], x_val.shape[1], x_val.element_size(),
                                            recipe.per_row, ctx)
        if config.cost_model == "roofline" and not estimate.profitable:
            log.add(_row(gid, node, "rejected", f"recipe {config.fp8}; {estimate.reason()}", [x_val, w_val], estimate))
            continue
        with gm.graph.inserting_before(node):
            call = gm.graph.call_function(torch.ops.fusion.fp8_linear.default, (a, w, config.fp8, config.fp8_emulate))
        call.meta["val"] = val(node)
        if "stack_trace" in node.meta:
            call.meta["stack_trace"] = node.meta["stack_trace"]
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        reason = estimate.reason() if config.cost_model == "roofline" else \
            f"cost model off (cost_model='always'); {estimate.reason()}"
        mode = ", emulated" if config.fp8_emulate else ""
        log.add(_row(gid, call, "applied", f"recipe {config.fp8}{mode}; {reason}", [x_val, w_val], estimate))
        applied += 1
    if applied:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return applied
