"""MoE family, the router's top-k: torch.topk over short rows (expert scores) becomes fusion::topk, one
launch (codegen/topk.py) instead of ATen's radix select and the sort of its k winners.

    before: values, indices = aten.topk(scores, k, -1)        after: values, indices = fusion.topk(scores, k)
Any topk over the last dim (largest, sorted) of rows up to codegen.topk.MAX_WIDTH wide with
k <= MAX_K is a candidate; the softmax or sigmoid before it and the renormalisation after it stay in
Inductor's fused kernels. A pass of its own: the two outputs are siblings, which a search function's
outputs cannot be.
"""
import types

import torch
import torch.fx as fx

from fusion_compiler import cost
from fusion_compiler.canonical import val
from fusion_compiler.codegen import topk as kernels
from fusion_compiler.codegen.launch import can_launch
from fusion_compiler.decisions import Decision, describe, location

from .checks import float_dtype

DESCRIPTOR = types.SimpleNamespace(name="moe_router_topk", family="moe")
KERNEL = "fusion::topk"
aten = torch.ops.aten


def _candidate(node: fx.Node) -> tuple | None:
    """(scores node, k) of a topk over the last dim, largest first and sorted; None otherwise."""
    if node.op != "call_function" or node.target is not aten.topk.default:
        return None
    args = list(node.args) + [None] * (5 - len(node.args))
    scores, k, dim, largest, ordered = args[:5]
    dim = node.kwargs.get("dim", -1 if dim is None else dim)
    largest = node.kwargs.get("largest", True if largest is None else largest)
    ordered = node.kwargs.get("sorted", True if ordered is None else ordered)
    rank = val(scores).dim()
    if not isinstance(k, int) or dim not in (-1, rank - 1) or not largest or not ordered or rank == 0:
        return None
    return scores, k


def _legal(scores: torch.Tensor, k: int) -> str | None:
    if not all(isinstance(size, int) for size in scores.shape):
        return f"dynamic shape {list(scores.shape)}: the kernel's tile follows the row width"
    return can_launch(scores.device) or float_dtype(scores) or kernels.supports(scores, k)


def rewrite(gm: fx.GraphModule, config, log, gid: int, needs_grad: set) -> int:
    """Replace every legal top-k that pays; one decision row each."""
    if not config.enables(DESCRIPTOR):
        return 0
    applied = 0
    for node in list(gm.graph.nodes):
        found = _candidate(node)
        if found is None:
            continue
        scores, k = found
        value = val(scores)
        why = _legal(value, k)
        estimate = None
        if why is None:
            ctx = cost.CostContext.of(value.device, config, node in needs_grad)
            estimate = cost.estimate_topk(value, k, ctx)
            if config.cost_model == "roofline" and not estimate.profitable:
                why = estimate.reason()
        verdict = "rejected" if why else "applied"
        reason = why or (estimate.reason() if config.cost_model == "roofline" else
                         f"cost model off (cost_model='always'); {estimate.reason()}")
        log.add(Decision(gid, DESCRIPTOR.name, DESCRIPTOR.family, verdict, f"top-{k} over the last dim: {reason}",
                         location(node), (describe(value), repr(k)),
                         bytes_saved=estimate.bytes_saved if estimate else None,
                         time_saved_us=round(estimate.time_saved_s * 1e6, 2) if estimate else None, kernel=KERNEL))
        if why:
            continue
        with gm.graph.inserting_before(node):
            call = gm.graph.call_function(torch.ops.fusion.topk.default, (scores, k))
        call.meta.update({key: node.meta[key] for key in ("stack_trace", "nn_module_stack") if key in node.meta})
        call.meta["val"] = torch.ops.fusion.topk.default(value, k)
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        applied += 1
    if applied:
        gm.recompile()
    return applied
