"""Optimizer family: compiled optimizer steps become one multi-tensor kernel launch per program.

The graph side (lift, unroll foreach calls, lanes, rewrite) is fusion_compiler/state_update.py; here
each group of lanes is named after the update it computes, checked (device, layout) and decided by
the cost model, with one decision row per group:

    optimizer_adam           two moments, a square-root denominator (Adam, AdamW)
    optimizer_adam_amsgrad   the same with a running maximum of the second moment
    optimizer_sgd_momentum   one momentum buffer (SGD with momentum, Nesterov or not)
    optimizer_sgd            the parameter alone
    optimizer_lion           the sign of an interpolated momentum (Lion)
    optimizer_update         any other elementwise update of several tensors
A global-norm gradient clip in the same graph (torch.nn.utils.clip_grad_norm_) adds the
`clip_grad_norm` row: the norms in one launch (fusion::multi_tensor_sum_squares) and the clip
coefficient folded into the update as one more per-lane scalar.
"""
import types

import torch
import torch.fx as fx

from fusion_compiler import cost, state_update
from fusion_compiler.codegen import multi_tensor
from fusion_compiler.codegen.launch import can_launch
from fusion_compiler.decisions import Decision, describe, location
from fusion_compiler.patterns.checks import float_dtype, one_device

FAMILY = "optimizer"
NAMES = ("optimizer_adam", "optimizer_adam_amsgrad", "optimizer_sgd_momentum", "optimizer_sgd",
         "optimizer_lion", "optimizer_update", "clip_grad_norm")
DESCRIPTORS = tuple(types.SimpleNamespace(name=n, family=FAMILY) for n in NAMES)
CLIP = next(d for d in DESCRIPTORS if d.name == "clip_grad_norm")
KERNEL = "fusion::multi_tensor_apply"
aten = torch.ops.aten


def classify(program, states: int) -> str:
    """The update's name from its ops and the number of state tensors it writes (besides the
    parameter; gradients, which foreach SGD with Nesterov momentum also writes, are not state)."""
    ops = {op for op, _, _ in program.steps}
    if len(program.writes) == 1 and len(program.steps) == 1 and program.steps[0][0] == "mul" \
            and {kind for kind, _ in program.steps[0][1]} == {"w", "s"}:
        return "clip_grad_norm"  # the scale of a gradient clip in a graph of its own: g *= coefficient
    if "sign" in ops:
        return "optimizer_lion"
    if "sqrt" in ops or "rsqrt" in ops:
        return "optimizer_adam_amsgrad" if "maximum" in ops and states >= 3 else \
            "optimizer_adam" if states >= 2 else "optimizer_update"
    if states == 1:
        return "optimizer_sgd_momentum"
    return "optimizer_sgd" if states == 0 else "optimizer_update"


def _lane_reason(lane, example: dict) -> str:
    tensors = [example[ph] for ph in lane.reads + lane.writes]
    why = one_device(tensors) or can_launch(tensors[0].device)
    if why:
        return why
    for t in tensors:
        if not t.is_contiguous():
            return f"non-contiguous tensor {describe(t)} (strides {list(t.stride())})"
    return ""


def _bytes(lane, example: dict) -> tuple[int, int, int, int]:
    """(ours, Inductor, eager, eager ops): ours reads each slot once and writes each written slot
    once; Inductor also stores what we leave unstored; eager reads the tensor arguments of each op
    and writes its result."""
    numel = example[lane.writes[0]].numel()
    ours = sum(example[ph].element_size() for ph in lane.reads + lane.writes * 2) * numel
    inductor = ours + sum(example[ph].element_size() for ph in lane.unstored) * numel
    eager = 0
    for v in lane.values:
        args = [a for a in state_update.flat_args((v.args, tuple(v.kwargs.values())))
                if isinstance(a, state_update.Value) and a.is_tensor]
        eager += (len(args) + 1) * numel * (v.node.meta["val"].element_size())
    return ours, inductor, eager, len(lane.values)


def _estimate(group, example, foreach: bool, ctx, normed: set) -> cost.Estimate:
    totals = [sum(values) for values in zip(*(_bytes(lane, example) for lane in group))]
    norm_bytes = sum(example[ph].numel() * example[ph].element_size() for lane in group
                     for ph in {*lane.reads, *lane.writes} if ph in normed)
    return cost.estimate_multi_tensor(*totals, len(group), foreach, ctx, norm_bytes)


def _kernel_failure(program, device) -> str | None:
    try:
        multi_tensor.verify(program, device)
    except Exception as e:  # noqa: BLE001  (any failure leaves the update to the hand-off)
        return f"generated kernel failed to compile or run: {type(e).__name__}: {str(e)[:200]}"
    return None


def rewrite(gm: fx.GraphModule, example_inputs, grads: set, foreach: bool, config, log, gid: int,
            report_unfused: bool = True) -> int:
    """Fuse the lanes of a traced update graph (grads: positions of the inputs that are gradients;
    foreach: the graph was spelled with foreach ops); returns how many groups were rewritten.
    report_unfused=False: when nothing is fused, log nothing (a graph without gradients or optimizer
    state that writes some inputs, e.g. a KV cache under no_grad, then takes the usual path with
    its own rows)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    example = dict(zip(placeholders, example_inputs))
    gradients = {placeholders[i] for i in grads}
    vals = state_update.values_of(gm)
    candidates, rows, rejected = [], [], {}
    for lane in state_update.lanes(vals):
        if config.skip_clipped_grad_store and any(ph not in gradients for ph in lane.writes):
            lane.unstored = [ph for ph in lane.writes if ph in gradients]
            lane.reads += lane.unstored  # read, no longer stored
            lane.writes = [ph for ph in lane.writes if ph not in gradients]
        try:
            lane.program = state_update.program_of(lane, vals)
        except state_update.NotFusable as e:
            lane.reason = str(e)
        lane.reason = lane.reason or _lane_reason(lane, example)
        if lane.reason:
            rejected.setdefault(lane.reason, []).append(lane)
        else:
            candidates.append(lane)
    rows += [("optimizer_update", "rejected", reason, lanes) for reason, lanes in rejected.items()]
    if vals.opaque_writes:
        rows.append(("optimizer_update", "rejected", f"tensors written by {', '.join(vals.opaque_writes)}: not "
                     "an elementwise chain this family reads (a fused optimizer is one kernel already)", []))
    groups: dict = {}
    for lane in candidates:
        groups.setdefault((lane.program.text(), example[lane.writes[0]].device), []).append(lane)
    why = state_update.residual_reason(vals, candidates)
    device = next(iter(example[lane.writes[0]].device for lane in candidates), torch.device("cpu"))
    ctx = cost.CostContext(cost.profile_for(device, config.device_profile), config.baseline, False)
    normed = {n.args[0] for norms in _norm_groups(gm, example) for n in norms} if config.enables(CLIP) else set()
    applied = []
    for group in groups.values():
        name = classify(group[0].program, sum(ph not in gradients for ph in group[0].writes) - 1)
        if why:
            rows.append((name, "near-miss", why, group))
            continue
        if not config.enables(types.SimpleNamespace(name=name, family=FAMILY)):
            rows.append((name, "rejected", "disabled by the config", group))
            continue
        failure = _kernel_failure(group[0].program, example[group[0].writes[0]].device) \
            if config.verify_kernels else None
        if failure:
            rows.append((name, "rejected", failure, group))
            continue
        estimate = _estimate(group, example, foreach, ctx, normed)
        if config.cost_model == "always" or estimate.profitable:
            applied.append(group)
            forced = "cost model off (cost_model='always'); " if config.cost_model == "always" else ""
            rows.append((name, "applied", f"{forced}one launch: {estimate.reason()}", group, estimate))
        else:
            rows.append((name, "rejected", estimate.reason(), group, estimate))
    if applied:
        state_update.rewrite(gm, vals, applied)
        clipped = fuse_norms(gm, example) if config.enables(CLIP) else 0
        if clipped:
            rows.append(("clip_grad_norm", "applied", f"{clipped} gradient norms in one launch", []))
    if not applied and not report_unfused:
        return 0
    for name, verdict, reason, group, *estimate in rows:
        est = estimate[0] if estimate else None
        anchor = group[0].values[-1].node if group and group[0].values else None
        tensors = [example[ph] for lane in group[:4] for ph in lane.writes[:1]]
        log.add(Decision(gid, name, FAMILY, verdict, reason, location(anchor),
                         tuple(describe(t) for t in tensors) + (("...",) if len(group) > 4 else ()),
                         est.bytes_saved if est else None,
                         round(est.time_saved_s * 1e6, 2) if est else None, KERNEL))
    return len(applied)


def _restack(graph: fx.Graph, values: list, roots: fx.Node) -> None:
    """clip_grad_norm_ stacks the norms it took (torch.stack(norms)): a stack of all of them in order
    is `roots` itself (Inductor would otherwise copy them back into a new tensor, kernels of their own)."""
    for user in list(values[0].users):
        dim = user.args[1] if len(user.args) > 1 else user.kwargs.get("dim", 0)
        if user.op == "call_function" and user.target is aten.stack.default and list(user.args[0]) == values \
                and all(v.target is aten.select.int for v in values) and dim == 0:
            user.replace_all_uses_with(roots)
            graph.erase_node(user)


def _norm_groups(gm: fx.GraphModule, example: dict) -> list:
    """The 2-norms of graph inputs that fuse_norms takes, by dtype and device (two or more each)."""
    groups: dict = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target == aten.linalg_vector_norm.default and len(n.args) >= 1 \
                and n.args[0] in example and n.args[1:2] in ((), (2,), (2.0,)) and not n.kwargs.get("dim") \
                and not n.kwargs.get("dtype") and len(n.args) <= 2:
            t = example[n.args[0]]
            if float_dtype(t) is None and t.is_contiguous() and can_launch(t.device) is None:
                groups.setdefault((t.dtype, t.device), []).append(n)
    return [norms for norms in groups.values() if len(norms) >= 2]


def fuse_norms(gm: fx.GraphModule, example: dict) -> int:
    """2-norms of several graph inputs of one dtype and device (a global-norm clip's first pass)
    become one fusion::multi_tensor_sum_squares launch; returns how many norms it took."""
    taken = 0
    for norms in _norm_groups(gm, example):
        first = min(norms, key=list(gm.graph.nodes).index)
        with gm.graph.inserting_before(first):
            sums = gm.graph.call_function(torch.ops.fusion.multi_tensor_sum_squares.default,
                                          ([n.args[0] for n in norms],))
            roots = gm.graph.call_function(aten.sqrt.default, (sums,))
            values = []
            for i, n in enumerate(norms):
                value = gm.graph.call_function(aten.select.int, (roots, 0, i))
                dtype = example[n.args[0]].dtype
                if dtype != torch.float32:
                    value = gm.graph.call_function(aten._to_copy.default, (value,), {"dtype": dtype})
                values.append(value)
        for n, value in zip(norms, values):
            n.replace_all_uses_with(value)
            gm.graph.erase_node(n)
        _restack(gm.graph, values, roots)
        taken += len(norms)
    gm.graph.lint()
    gm.recompile()
    return taken
