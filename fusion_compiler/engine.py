"""The pass: match every enabled pattern, decide each candidate, rewrite the ones that pay.

For each pattern (largest priority first) and each node computing its anchor op:
  1. loose structural match (matcher.py), then exact verification against the search function
     re-traced at the region's real shapes, dtypes and scalars
  2. near-miss when an intermediate of the region is used outside it
  3. can_apply (legal), then should_apply (cost), then a one-time run of the replacement on random
     data of the region's signature (a kernel that fails to compile or run is rejected, not shipped)
  4. rewrite: the replacement, traced to ATen, is inlined after the region's last input; the region's
     outputs are redirected (cast back to their dtype where the op's differs) and the rest is DCE'd.
Every candidate becomes a Decision.
"""
import dataclasses

import torch
import torch.fx as fx

from . import _compat, constants, cost
from .canonical import trace_function, val
from .decisions import Decision, DecisionLog, describe, location
from .matcher import Match, Matcher, candidates
from .pattern import registered_patterns, scalars

_VERIFIED: dict = {}  # (pattern, signature, training) -> None or the failure


def _needs_grad(gm: fx.GraphModule, grad_inputs: list[bool]) -> set:
    """Nodes whose value carries a gradient (from requires_grad inputs, stopped by detach)."""
    grad = set()
    placeholders = iter(grad_inputs)
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            if next(placeholders, False):
                grad.add(n)
        elif n.op == "call_function" and n.target is not torch.ops.aten.detach.default:
            if any(a in grad for a in n.all_input_nodes):
                grad.add(n)
    return grad


def random_like(v: torch.Tensor) -> torch.Tensor:
    span = 1 + sum((s - 1) * st for s, st in zip(v.shape, v.stride())) if v.numel() else 0
    if v.is_floating_point() or v.is_complex():
        base = torch.randn(span, dtype=v.dtype, device=v.device)
    else:
        base = torch.zeros(span, dtype=v.dtype, device=v.device)
    return base.as_strided(v.shape, v.stride())


def verify_replacement(pattern, values: list, training: bool) -> str | None:
    """Run the replacement once (fwd, and bwd when training) on random data of this signature."""
    key = (pattern.name, training, tuple(
        (tuple(v.shape), tuple(v.stride()), v.dtype, str(v.device)) if isinstance(v, torch.Tensor) else v
        for v in values))
    if key not in _VERIFIED:
        try:
            # outside Dynamo's tracing context: FlexAttention's eager backward traces its score_mod
            # and would pick up Dynamo's fake mode for our real tensors
            with torch.enable_grad(), _compat.tracing(None):
                args, leaves = [], []
                for v in values:
                    r = random_like(v) if isinstance(v, torch.Tensor) else v
                    if training and isinstance(r, torch.Tensor) and (r.is_floating_point() or r.is_complex()):
                        r = r.requires_grad_()
                        leaves.append(r)
                    args.append(r)
                out = pattern.replacement(*args)
                outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if o.requires_grad]
                if outs and leaves:
                    torch.autograd.grad(outs, leaves, [torch.randn_like(o) for o in outs], allow_unused=True)
            _VERIFIED[key] = None
        except Exception as e:  # noqa: BLE001  (any failure keeps the region off our kernels)
            _VERIFIED[key] = f"kernel failed on this signature: {type(e).__name__}: {str(e)[:200]}"
    return _VERIFIED[key]


def layout_change(match, replacement: fx.GraphModule) -> str | None:
    """The graph downstream was traced against the region's output layouts (a later view may rely
    on them): a replacement must produce the same shapes and strides."""
    out = next(n for n in replacement.graph.nodes if n.op == "output").args[0]
    new = out if isinstance(out, (list, tuple)) else (out,)
    for old, nn_ in zip(match.outputs, new):
        ov, nv = val(old), val(nn_)
        if ov is None or nv is None:
            continue
        if tuple(ov.shape) != tuple(nv.shape) or (ov.numel() > 1 and tuple(ov.stride()) != tuple(nv.stride())):
            return (f"replacement output {list(nv.shape)} strides {tuple(nv.stride())} differs from the region's "
                    f"{list(ov.shape)} strides {tuple(ov.stride())}")
    return None


_PASS_THROUGH = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten._to_copy.default,
                 torch.ops.aten.slice.Tensor)


def returned_only(node: fx.Node) -> list[fx.Node] | None:
    """The nodes that hand `node` to the graph's output when every use of it is a return (through
    views, slices and casts: HF's outputs.logits); None when it has any other use."""
    ends = []
    for user in node.users:
        if user.op == "output":
            ends.append(node)
        elif user.op == "call_function" and user.target in _PASS_THROUGH:
            sub = returned_only(user)
            if sub is None:
                return None
            ends.extend(sub)
        else:
            return None
    return ends


def _droppable(match, config, training: bool) -> tuple[list[fx.Node], set]:
    """With FusionConfig(drop_logits=True), in training: (the nodes a loss region's intermediates
    are returned through, which the rewrite replaces by empty tensors; the outside users that start
    those returns). Nothing when an intermediate has any other use."""
    if not (config.drop_logits and training and match.pattern.family == "loss"):
        return [], set()
    inside = set(match.nodes)
    ends, heads = [], set()
    for n in match.nodes:
        if n in match.outputs:
            continue
        for user in n.users:
            if user not in inside:
                sub = [n] if user.op == "output" else returned_only(user)
                if sub is None:
                    return [], set()
                ends.extend(sub)
                heads.add(user)
    return ends, heads


def _mutates(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return schema is not None and schema.is_mutable


def _insertion_point(graph: fx.Graph, match, order: dict) -> tuple[fx.Node | None, str]:
    """(the node after which the replacement goes, or None and why not): after the region's last
    input and after every in-place op that ran before the region (it may write into an input)."""
    inputs = [a for a in match.inputs if isinstance(a, fx.Node)]
    first, end = min(order[n] for n in match.nodes), max(order[n] for n in match.nodes)
    inside = set(match.nodes)
    mutations = [n for n in graph.nodes if _mutates(n) and n not in inside and order[n] < end]
    if any(order[m] > first for m in mutations):
        return None, "an in-place op runs between the region's nodes"
    candidates = inputs + mutations
    last = max(candidates, key=lambda n: order[n]) if candidates else next(iter(graph.nodes))
    for out in match.outputs:
        for user in out.users:
            if user not in match.nodes and order[user] <= order[last]:
                return None, "an output is used before the region's last input is computed"
    return last, ""


def drop_returns(graph: fx.Graph, ends: list[fx.Node]) -> None:
    """Return an empty tensor of the same dtype and device in place of each of `ends`."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    for end in dict.fromkeys(ends):
        v = val(end)
        with graph.inserting_before(output):
            empty = graph.call_function(torch.ops.aten.empty.memory_format, ([0],),
                                        {"dtype": v.dtype, "device": v.device})
        empty.meta["val"] = v.new_empty(0)
        output.replace_input_with(end, empty)


def rewrite_region(gm: fx.GraphModule, match, replacement: fx.GraphModule, after: fx.Node,
                   dropped: list[fx.Node] = ()) -> None:
    graph = gm.graph
    placeholders = [n for n in replacement.graph.nodes if n.op == "placeholder"]
    env = {ph: a for ph, a in zip(placeholders, match.inputs) if isinstance(a, fx.Node)}
    trace = match.anchor.meta.get("stack_trace")
    region = set(match.nodes)
    new_outs = None
    with graph.inserting_before(after.next):
        for n in replacement.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                res = n.args[0]
                new_outs = [env[r] for r in (res if isinstance(res, (list, tuple)) else (res,))]
                continue
            if n.op == "get_attr":  # a subgraph of a higher-order op (FlexAttention's score_mod)
                name = _fresh_attr(gm, n.target)
                gm.add_submodule(name, getattr(replacement, n.target))
                env[n] = graph.get_attr(name)
                env[n].meta = dict(n.meta)
                continue
            env[n] = graph.node_copy(n, lambda a: env[a])
            if trace:
                env[n].meta["stack_trace"] = trace
        for old, new in zip(match.outputs, new_outs):
            ov, nv = val(old), val(new)
            if ov is not None and nv is not None and ov.dtype != nv.dtype:
                cast = graph.call_function(torch.ops.aten._to_copy.default, (new,), {"dtype": ov.dtype})
                cast.meta["val"] = ov
                new = cast
            # users inside the region are about to die (and may sit before the insertion point)
            old.replace_all_uses_with(new, delete_user_cb=lambda user: user not in region)
    drop_returns(graph, list(dropped))
    graph.eliminate_dead_code()


def _fresh_attr(gm: fx.GraphModule, base: str) -> str:
    i = 0
    while hasattr(gm, f"fusion_{base}_{i}"):
        i += 1
    return f"fusion_{base}_{i}"


def known_names() -> list:
    """Every pattern and every name of the families with their own passes (gemm, optimizer)."""
    from fusion_compiler.patterns import fp8, gemm, gemm_horizontal, moe, optimizer, sdpa_causal, topk
    return (registered_patterns() + list(optimizer.DESCRIPTORS) + list(gemm.DESCRIPTORS)
            + [gemm_horizontal.DESCRIPTOR] + list(moe.DESCRIPTORS)
            + [topk.DESCRIPTOR, fp8.DESCRIPTOR, sdpa_causal.DESCRIPTOR])


def run(gm: fx.GraphModule, config, log: DecisionLog, graph_id: int, grad_inputs: list[bool]) -> int:
    """Rewrite gm in place; returns how many regions were rewritten. grad_inputs: per placeholder,
    does that input require grad (decides whether the cost model counts the backward)."""
    from fusion_compiler.patterns import fp8, gemm, gemm_horizontal, moe, sdpa_causal, topk
    patterns = registered_patterns()
    config.check_names(known_names())
    needs_grad = _needs_grad(gm, grad_inputs)
    # first: routed experts (their activation and products would otherwise be taken one by one), then
    # their router's top-k
    applied = moe.rewrite(gm, config, log, graph_id, needs_grad)
    applied += topk.rewrite(gm, config, log, graph_id, _needs_grad(gm, grad_inputs))
    if applied:
        needs_grad = _needs_grad(gm, grad_inputs)
    dynamic = next((n for n in gm.graph.nodes if _compat.has_unbacked(n.meta.get("val"))), None)
    if dynamic is not None:  # the patterns below assume sizes known at compile time
        log.add(Decision(graph_id, "-", "-", "fallback", f"data-dependent sizes in the graph ({dynamic.name}, "
                         f"{dynamic.target}): the families after MoE are skipped, the rest goes to {config.handoff}",
                         location(dynamic), ()))
        constants.release(gm.graph)
        gm.recompile()
        return applied
    for pattern in patterns:
        if not config.enables(pattern):
            continue
        loose = Matcher(pattern.graph(), pattern.scalar_names, exact=False)
        live = set(gm.graph.nodes)  # changes only when a rewrite erases nodes
        for anchor in candidates(gm.graph, loose.anchor_target):
            if anchor not in live:
                continue
            match = loose.match(pattern, anchor)
            if match is None:
                continue
            decision, replacement, dropped, match = _decide(pattern, match, config, needs_grad, graph_id)
            if replacement is not None:
                order = {n: i for i, n in enumerate(gm.graph.nodes)}
                after, why = _insertion_point(gm.graph, match, order)
                if after is None:
                    decision = _row(graph_id, pattern, match, "near-miss", why)
                else:
                    rewrite_region(gm, match, replacement, after, dropped)
                    needs_grad = _needs_grad(gm, grad_inputs)
                    live = set(gm.graph.nodes)
                    applied += 1
            log.add(decision)
    # SDPA calls the model made itself (or the patterns above emitted) with a constant causal mask
    applied += sdpa_causal.rewrite(gm, config, log, graph_id, _needs_grad(gm, grad_inputs))
    # FP8 linears (opt-in), then a GEMM's chain is what the patterns above left of it; then products
    # sharing an input
    applied += fp8.rewrite(gm, config, log, graph_id, _needs_grad(gm, grad_inputs))
    applied += gemm.rewrite(gm, config, log, graph_id, _needs_grad(gm, grad_inputs))
    applied += gemm_horizontal.rewrite(gm, config, log, graph_id, _needs_grad(gm, grad_inputs))
    constants.release(gm.graph)
    gm.recompile()
    return applied


def _row(graph_id, pattern, match, verdict, reason, estimate=None) -> Decision:
    return Decision(
        graph=graph_id, pattern=pattern.name, family=pattern.family, verdict=verdict, reason=reason,
        location=location(match.anchor), inputs=tuple(describe(v) for v in match.input_values()),
        bytes_saved=estimate.bytes_saved if estimate else None,
        time_saved_us=round(estimate.time_saved_s * 1e6, 2) if estimate else None,
        kernel=pattern.kernel,
    )


def _decide(pattern, match, config, needs_grad, gid) -> tuple[Decision, fx.GraphModule | None, list, Match]:
    match, failure = _verified(pattern, match)
    if failure:
        return _row(gid, pattern, match, "near-miss", failure), None, [], match
    decision, replacement, dropped = _decide_region(pattern, match, config, needs_grad, gid)
    if replacement is not None and dropped:
        decision = dataclasses.replace(decision, reason=decision.reason + f"; returned logits dropped "
                                       f"({', '.join(n.name for n in dropped)}: empty tensors, drop_logits=True)")
    return decision, replacement, dropped, match


def _verified(pattern, match) -> tuple[Match, str | None]:
    """The loose match checked against the search function re-traced at its inputs' real shapes,
    dtypes and scalars. Inputs are read through the user's float casts first; where the search
    function does not trace at those dtypes (bf16 scores plus an fp32 mask the user cast to bf16),
    the inputs are bound with their casts instead."""
    failure = None
    for read_casts in (True, False):
        if not read_casts:
            match = Matcher(pattern.graph(), pattern.scalar_names, exact=False, read_casts=False).match(
                pattern, match.anchor) or match
        values = match.input_values()
        try:
            graph = pattern.graph_at(values)
        except Exception as e:  # noqa: BLE001 - a search function that cannot run at these inputs
            failure = f"the search function does not trace at these inputs: {type(e).__name__}: {e}"
            continue
        exact = Matcher(graph, scalars(values), exact=True, read_casts=read_casts).match(pattern, match.anchor)
        if exact is None or set(exact.nodes) != set(match.nodes):
            return match, "structure matches but sizes or constants differ from the pattern at these shapes"
        return match, None
    return match, failure


def _escape_reason(inner, user, pattern) -> str:
    where = location(user)
    reason = f"intermediate {inner.name} is also used by {user.name}" + (f" ({where})" if where else "")
    if pattern.family == "loss" and (user.op == "output" or returned_only(user) is not None):
        reason += ("; it is only returned (e.g. HF's outputs.logits): FusionConfig(drop_logits=True) returns "
                   "an empty tensor instead in training")
    return reason


def _decide_region(pattern, match, config, needs_grad, gid) -> tuple[Decision, fx.GraphModule | None, list]:
    values = match.input_values()
    training = any(isinstance(a, fx.Node) and a in needs_grad for a in match.inputs)
    dropped, heads = _droppable(match, config, training)
    escape = match.escaping(ignore=heads.__contains__)
    if escape is not None:
        return _row(gid, pattern, match, "near-miss", _escape_reason(*escape, pattern)), None, []
    if pattern.can_apply is not None:
        why = pattern.can_apply(match)
        if why:
            return _row(gid, pattern, match, "rejected", why), None, []
    device = next((v.device for v in match.tensor_inputs()), torch.device("cpu"))
    ctx = cost.CostContext.of(device, config, training)
    estimate = (pattern.should_apply or cost.estimate_fused)(match, ctx)
    if pattern.fp8_producer:
        from fusion_compiler.patterns import fp8
        estimate = fp8.with_cast_credit(estimate, match.outputs[0], config, needs_grad)
    if config.cost_model == "roofline" and not estimate.profitable:
        return _row(gid, pattern, match, "rejected", estimate.reason(), estimate), None, []
    grads = [isinstance(a, fx.Node) and a in needs_grad for a in match.inputs]
    try:
        replacement = trace_function(pattern.replacement, _with_grad_flags(values, grads))
    except Exception as e:  # noqa: BLE001
        failure = verify_replacement(pattern, values, training) if config.verify_kernels else None
        return _row(gid, pattern, match, "rejected", failure or
                    f"replacement failed to trace: {type(e).__name__}: {e}", estimate if failure else None), None, []
    if any(n.op == "get_attr" and not isinstance(getattr(replacement, n.target), fx.GraphModule)
           for n in replacement.graph.nodes):
        return _row(gid, pattern, match, "rejected",
                    "replacement creates tensor constants; compute them inside an op instead"), None, []
    layout = layout_change(match, replacement)
    if layout:
        return _row(gid, pattern, match, "rejected", layout), None, []
    estimate = cost.with_host_time(estimate, _op_calls(replacement, training), ctx)
    if config.cost_model == "roofline" and not estimate.profitable:
        return _row(gid, pattern, match, "rejected", estimate.reason(), estimate), None, []
    if config.verify_kernels:  # last: it runs the kernels (the interpreter on CPU)
        failure = verify_replacement(pattern, values, training)
        if failure:
            return _row(gid, pattern, match, "rejected", failure, estimate), None, []
    reason = estimate.reason() if config.cost_model == "roofline" else \
        f"cost model off (cost_model='always'); {estimate.reason()}"
    return _row(gid, pattern, match, "applied", reason, estimate), replacement, dropped


def _op_calls(replacement: fx.GraphModule, training: bool) -> int:
    """Project-op calls a step makes for the replacement: each op once forward, once more backward."""
    ops = sum(n.op == "call_function" and isinstance(n.target, _compat.OpOverload) and n.target.namespace == "fusion"
              for n in replacement.graph.nodes)
    return ops * (2 if training else 1)


def _with_grad_flags(values: list, grads: list[bool]) -> list:
    """The region's input values with requires_grad as in the user's graph, so a replacement can
    skip gradient work in inference (it sees h.requires_grad)."""
    return [v.detach().requires_grad_(g) if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())
            else v for v, g in zip(values, grads)]
