"""GEMM family, horizontal: linears that share their input become one GEMM over concatenated weights.

    before:  q = F.linear(x, wq); k = F.linear(x, wk); v = F.linear(x, wv)        (biases too)
    after:   q, k, v = (x @ cat([wq, wk, wv]).t()).split([Nq, Nk, Nv], -1)

In training autograd splits the weight gradient back (the backward of cat) and concatenates the
output gradients (the backward of split): both are copies, which the cost model counts
(cost.estimate_horizontal) against the launches and the tile waves saved. The parts are strided
views of the wide product; the views downstream of each part are re-run on the new layout first,
and a group whose downstream cannot take it is left alone, with the reason.

Runs after the epilogue pass, on the products it left (q/k/v projections followed by views, gate/up
projections feeding a GLU op).
"""
import collections
import operator
import types

import torch
import torch.fx as fx

from fusion_compiler import cost
from fusion_compiler.canonical import val
from fusion_compiler.decisions import Decision, describe, location

DESCRIPTOR = types.SimpleNamespace(name="gemm_horizontal", family="gemm")
aten = torch.ops.aten

# ops whose result depends on the input's strides (re-run on the new layout before rewriting)
_STRIDED = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.transpose.int, aten.t.default,
            aten.permute.default, aten.expand.default, aten.unsqueeze.default, aten.slice.Tensor, aten.select.int,
            aten.split.Tensor, aten.split_with_sizes.default, aten.unflatten.int, operator.getitem)


def linear_operands(node: fx.Node):
    """(input, weight [N, K], bias or None) of an F.linear-shaped mm / addmm, else None."""
    if node.op != "call_function":
        return None
    if node.target is aten.mm.default:
        a, bt, bias = node.args[0], node.args[1], None
    elif node.target is aten.addmm.default and node.kwargs.get("beta", 1) == 1 and node.kwargs.get("alpha", 1) == 1:
        bias, a, bt = node.args[:3]
        if val(bias).dim() != 1:
            return None
    else:
        return None
    if not (isinstance(bt, fx.Node) and bt.op == "call_function" and bt.target is aten.t.default):
        return None
    w = bt.args[0]
    v = val(w)
    if not isinstance(v, torch.Tensor) or v.dim() != 2:
        return None
    return a, w, bias


_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _source(a: fx.Node):
    """What the input is a view of: F.linear on [B, S, K] views x as [B*S, K] once per linear."""
    if a.op == "call_function" and a.target in _VIEWS:
        return a.args[0], tuple(val(a).shape)
    return a


def groups(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """Linears of the same input (or of the same view of it), the same op (all with bias or none),
    dtype and device."""
    found = collections.defaultdict(list)
    for node in gm.graph.nodes:
        parts = linear_operands(node)
        if parts is None:
            continue
        a, w, _ = parts
        found[(_source(a), node.target, val(w).dtype, val(w).device, val(w).shape[1])].append(node)
    return [g for g in found.values() if len(g) > 1]


def _downstream_ok(part: torch.Tensor, node: fx.Node) -> str | None:
    """Re-run the stride-dependent ops below `node` on its new value `part`; None, or what fails."""
    stack = [(node, part)]
    while stack:
        src, value = stack.pop()
        for user in src.users:
            # a returned tensor keeps its strides: the caller may view it as before
            if user.op == "output" and tuple(value.stride()) != tuple(val(src).stride()):
                return f"{src.name} is returned and would change its strides"
            if user.op != "call_function" or user.target not in _STRIDED:
                continue
            args = [value if a is src else val(a) if isinstance(a, fx.Node) else a for a in user.args]
            try:
                out = user.target(*args, **user.kwargs)
            except Exception as e:  # noqa: BLE001  (the layout is the reason, whatever the op says)
                return f"{user.name} cannot take the strided part: {type(e).__name__}: {str(e)[:120]}"
            stack.append((user, out))
    return None


def _row(gid, group, verdict, reason, estimate=None) -> Decision:
    a, *_ = linear_operands(group[0])
    inputs = [val(a)] + [val(linear_operands(n)[1]) for n in group]
    return Decision(gid, DESCRIPTOR.name, DESCRIPTOR.family, verdict, reason, location(group[0]),
                    tuple(describe(v) for v in inputs), bytes_saved=estimate.bytes_saved if estimate else None,
                    time_saved_us=round(estimate.time_saved_s * 1e6, 2) if estimate else None, kernel="aten.mm")


def rewrite(gm: fx.GraphModule, config, log, gid: int, needs_grad: set) -> int:
    """Concatenate each group whose estimate pays (or every legal one with cost_model="always")."""
    if not config.enables(DESCRIPTOR):
        return 0
    applied = 0
    for group in groups(gm):
        a, _, _ = linear_operands(group[0])
        weights = [val(linear_operands(n)[1]) for n in group]
        training = any(n in needs_grad for n in group)
        ctx = cost.CostContext(cost.profile_for(val(a).device, config.device_profile), config.baseline, training)
        estimate = cost.estimate_horizontal(val(a), weights, ctx)
        if config.cost_model == "roofline" and not estimate.profitable:
            log.add(_row(gid, group, "rejected", estimate.reason(), estimate))
            continue
        # the estimate alone does not move a model's GEMMs ("do no harm"): only a card where the rewrite
        # was timed faster on a real layer
        timed = ctx.profile.horizontal
        if config.cost_model == "roofline" and (not timed or timed[training] >= 1.0 - cost.MARGIN):
            found = (f"timed on {ctx.profile.name}: the Llama reference layer ran x{timed[training]:.3f} "
                     f"({'fwd+bwd' if training else 'fwd'}) with its linears concatenated" if timed else
                     f"not yet timed on {ctx.profile.name}")
            log.add(_row(gid, group, "rejected", f"keep inductor's separate GEMMs: {found} (cost_model='always' "
                         f"applies it); {estimate.reason()}", estimate))
            continue
        why = _concatenate(gm, group)
        if why:
            log.add(_row(gid, group, "rejected", why, estimate))
            continue
        reason = estimate.reason() if config.cost_model == "roofline" else \
            f"cost model off (cost_model='always'); {estimate.reason()}"
        log.add(_row(gid, group, "applied", f"{len(group)} linears as one GEMM over concatenated weights; {reason}",
                     estimate))
        applied += 1
    if applied:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return applied


def _concatenate(gm: fx.GraphModule, group: list) -> str | None:
    """Replace the group by one product and its split (None), or say why the layout does not fit."""
    parts = [linear_operands(n) for n in group]
    a = parts[0][0]
    sizes = [val(w).shape[0] for _, w, _ in parts]
    wide = val(group[0]).new_empty((val(group[0]).shape[0], sum(sizes)))
    pieces = wide.split(sizes, dim=-1)
    for node, piece in zip(group, pieces):
        why = _downstream_ok(piece, node)
        if why:
            return why
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    first_use = min(order[u] for n in group for u in n.users)
    inputs = [a] + [w for _, w, _ in parts] + [b for _, _, b in parts if b is not None]
    last_input = max(inputs, key=order.__getitem__)
    if order[last_input] > first_use:
        return "a weight is computed after a part is first used"
    graph = gm.graph
    with graph.inserting_before(last_input.next):
        w_cat = graph.call_function(aten.cat.default, ([w for _, w, _ in parts], 0))
        w_t = graph.call_function(aten.t.default, (w_cat,))
        if parts[0][2] is None:
            product = graph.call_function(aten.mm.default, (a, w_t))
        else:
            b_cat = graph.call_function(aten.cat.default, ([b for _, _, b in parts],))
            b_cat.meta["val"] = torch.cat([val(b) for _, _, b in parts])
            product = graph.call_function(aten.addmm.default, (b_cat, a, w_t))
        split = graph.call_function(aten.split_with_sizes.default, (product, sizes, -1))
        outs = [graph.call_function(operator.getitem, (split, i)) for i in range(len(group))]
    w_cat.meta["val"] = torch.cat([val(w) for _, w, _ in parts])
    w_t.meta["val"] = w_cat.meta["val"].t()
    product.meta["val"], split.meta["val"] = wide, list(pieces)
    for node, out, piece in zip(group, outs, pieces):
        out.meta["val"] = piece
        out.meta["stack_trace"] = node.meta.get("stack_trace")
        node.replace_all_uses_with(out)
    return None
