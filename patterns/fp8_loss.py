"""The FP8 LM head and its cross-entropy as one op (tensorwise recipe, training): part of the FP8 pass
(patterns/fp8.py), after it has taken the linear.

    before:  logits = fusion.fp8_linear_tensorwise(x, w, <casts>)      (also returned: HF's outputs.logits)
             loss = nll_loss_forward(log_softmax(logits[.float()], -1), target, None, mean|sum, i)[0]
    after:   logits, loss, ... = fusion.fp8_linear_tensorwise_cross_entropy(x, w, <casts>, target, i,
                                                                           mean|sum, emulate)

The loss's backward then writes the logits' gradient in e5m2 (both layouts) for the two FP8 GEMMs,
instead of Inductor's backward writing it in 16 bits and the linear's backward reading it twice to
cast it (ops/fp8_cross_entropy.py). Taken wherever the chain is exactly this: class weights, label
smoothing, soft-capping or a per-token loss keep the two ops apart (the FP8 linear stays). The
target's computation (HF shifts the labels after the LM head) moves before the linear when it does
not depend on it.
"""
import operator

import torch
import torch.fx as fx

from fusion_compiler import _compat
from fusion_compiler.canonical import val
from fusion_compiler.engine import drop_returns, returned_only

aten = torch.ops.aten
OP = torch.ops.fusion.fp8_linear_tensorwise_cross_entropy.default
_REDUCTIONS = {1: "mean", 2: "sum"}  # ATen's reduction enum
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _chain(call: fx.Node) -> tuple | None:
    """(log_softmax, nll_loss_forward, its loss getitem) of the cross-entropy reading call's logits
    through a cast to fp32 and views of the same 2-D shape, or None."""
    shape = tuple(val(call).shape)
    for start in call.users:
        node = start
        while node is not None and node.op == "call_function" and (
                node.target in _VIEWS or (node.target is aten._to_copy.default and set(node.kwargs) <= {
                    "dtype", "layout", "device", "pin_memory", "non_blocking", "memory_format"}
                    and node.kwargs.get("dtype") == torch.float32 and node.kwargs.get("memory_format") is None
                    and val(node).device == val(call).device)):
            if tuple(val(node).shape) != shape:
                break
            node = _only_user(node)
        if node is None or node.op != "call_function" or node.target is not aten._log_softmax.default:
            continue
        if node.args[1] not in (-1, 1) or tuple(val(node).shape) != shape:
            continue
        nll = _only_user(node)
        if nll is None or nll.target is not aten.nll_loss_forward.default or nll.args[0] is not node:
            continue
        loss = _only_user(nll)
        if loss is None or loss.target is not operator.getitem or loss.args[1] != 0:
            continue
        return node, nll, loss
    return None


def _legal(call: fx.Node, nll: fx.Node) -> str | None:
    """Why this cross-entropy stays apart, or None."""
    _, target, weight, reduction, _ = nll.args
    if weight is not None:
        return "class weights"
    if reduction not in _REDUCTIONS:
        return "a per-token loss (reduction none)"
    t = val(target)
    if not isinstance(target, fx.Node) or t.dim() != 1 or t.dtype != torch.int64 or t.shape[0] != val(call).shape[0]:
        return f"target {t.dtype}{list(t.shape)} is not int64 of one per row"
    return None


def _hoist(target: fx.Node, before: fx.Node) -> bool:
    """Move the nodes target is computed by that sit after `before` to just before it, in order; False
    (nothing moved) when one of them depends on `before` or is not pure."""
    order = {n: i for i, n in enumerate(before.graph.nodes)}
    late, stack, seen = [], [target], set()
    while stack:
        node = stack.pop()
        if node in seen or order[node] < order[before]:
            continue
        seen.add(node)
        if node is before or node.op != "call_function" or node.is_impure():
            return False
        late.append(node)
        stack.extend(n for n in node.all_input_nodes)
    for node in sorted(late, key=order.__getitem__):
        before.prepend(node)
    return True


_VERIFIED: dict = {}  # (dtype, device, reduction, emulate) -> None or the failure


def _verify(x: torch.Tensor, reduction: str, emulate: bool) -> str | None:
    """Run the op once, forward and backward, on small random data of x's dtype and device (its
    kernels compile the same at every size): a failure keeps the loss apart."""
    key = (x.dtype, str(x.device), reduction, emulate)
    if key not in _VERIFIED:
        try:
            with torch.enable_grad(), _compat.tracing(None):
                h = torch.randn(32, 64, dtype=x.dtype, device=x.device, requires_grad=True)
                w = torch.randn(48, 64, dtype=x.dtype, device=x.device, requires_grad=True)
                casts = [torch.ops.fusion.fp8_quantize_tensorwise(t.detach(), True, emulate) for t in (h, w)]
                target = torch.randint(0, 48, (32,), device=x.device)
                logits, loss, *_ = OP(h, w, *casts[0], *casts[1], target, -100, reduction, emulate)
                torch.autograd.grad([logits, loss], [h, w], [torch.randn_like(logits), torch.ones_like(loss)])
            _VERIFIED[key] = None
        except Exception as e:  # noqa: BLE001  (any failure keeps the loss off our kernels)
            _VERIFIED[key] = f"kernel failed: {type(e).__name__}: {str(e)[:200]}"
    return _VERIFIED[key]


def fuse(gm: fx.GraphModule, call: fx.Node, config) -> tuple[fx.Node, str | None]:
    """Rewrite the cross-entropy on fp8_linear_tensorwise `call`'s logits into the fused op; (the node
    now making the logits, a note for the decision row or None)."""
    found = _chain(call)
    if found is None:
        return call, None
    log_softmax, nll, loss = found
    why = _legal(call, nll)
    _, target, _, reduction, ignore_index = nll.args
    if why is None and config.verify_kernels:
        why = _verify(val(call), _REDUCTIONS[reduction], config.fp8_emulate)
    if why is None and not _hoist(target, call):
        why = "its target is computed from the logits"
    if why:
        return call, f"its cross-entropy stays apart ({why})"
    graph = gm.graph
    args = (*call.args[:8], target, ignore_index, _REDUCTIONS[reduction], config.fp8_emulate)
    with graph.inserting_before(call):
        fused = graph.call_function(OP, args)
        outs = [graph.call_function(operator.getitem, (fused, i)) for i in (0, 1)]
    fused.meta.update(call.meta)
    fused.meta["val"] = OP(*[val(a) if isinstance(a, fx.Node) else a for a in args])
    for out, value in zip(outs, fused.meta["val"]):
        out.meta["val"] = value
    logits, new_loss = outs
    if val(loss).dtype != torch.float32:  # cross-entropy on 16-bit logits returns a 16-bit loss
        with graph.inserting_after(new_loss):
            cast = graph.call_function(aten._to_copy.default, (new_loss,), {"dtype": val(loss).dtype})
        cast.meta["val"] = val(loss)
        new_loss = cast
    loss.replace_all_uses_with(new_loss)
    call.replace_all_uses_with(logits)
    for node in (loss, nll, log_softmax):
        graph.erase_node(node)
    graph.erase_node(call)
    n, v = val(logits).shape
    moved = 3 * n * v * val(logits).element_size()
    note = (f"its cross-entropy fused ({OP.name()}): the loss's backward writes the logits' gradient in e5m2, "
            f"both layouts, for the FP8 GEMMs; no {val(logits).dtype} gradient, amax pass or cast "
            f"({moved / 2**20:.0f} MiB less traffic)")
    ends = returned_only(logits) if config.drop_logits else None
    if ends:
        drop_returns(graph, ends)
        note += "; returned logits dropped (an empty tensor, drop_logits=True): no gradient of theirs to fill or read"
    elif config.drop_logits and ends is None:
        note += "; logits kept although drop_logits=True: the graph uses them for more than returning them"
    return fused, note
