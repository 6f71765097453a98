"""MoE family, the per-expert loop over a ModuleList (transformers 4.x's Mixtral and Qwen2-MoE experts):

    final = zeros(T, D);  mask = one_hot(index, E).permute(2, 1, 0)
    for e in range(E):
        slot, token = torch.where(mask[e])
        y = experts[e](x[token]) * weight[token, slot, None]     (experts[e]: w2(act(w1 x) * w3 x) or w2(act(w1 x)))
        final.index_add_(0, token, y.to(x.dtype))

Dynamo keeps it in one graph only while capture_dynamic_output_shape_ops is on (fusion_compiler.compile
turns it on while the compiled model runs: FusionConfig.capture_dynamic_output_shapes); each
torch.where is then a nonzero with a data-dependent size (a host sync). The E links of index_add become one
fusion::moe_experts call on the experts' nn.Linear weights stacked to [E, N, K] (one copy a step; the
gradient is split back to each weight). A loop whose trip count depends on the data (HF 5.x's
`for e in expert_hit`) still breaks the graph at .nonzero(): report_breaks gives it a near-miss row and
a warning naming the settings.
"""
import operator
import warnings

import torch
import torch.fx as fx

from fusion_compiler.canonical import is_float_cast, val
from fusion_compiler.decisions import Decision, describe, location
from fusion_compiler.patterns import moe as core

aten = torch.ops.aten


def expert_ids(node) -> fx.Node | None:
    """ids for node = one_hot(ids) or its decomposition eq(ids.unsqueeze(-1), arange(E)), where ids
    [T, k] are top-k expert ids computed here or handed over by the previous graph."""
    if core._call(node, aten.one_hot.default):
        ids = node.args[0]
    elif core._call(node, aten.eq.Tensor) and core._call(node.args[0], aten.unsqueeze.default) and core._call(
            node.args[1], aten.arange.default, aten.arange.start):
        ids = node.args[0].args[0]
    else:
        return None
    from_topk = core._call(ids, operator.getitem) and ids.args[1] == 1 and core._call(ids.args[0], aten.topk.default)
    return ids if (from_topk or ids.op == "placeholder") and val(ids).dim() == 2 else None


def report_breaks(gm: fx.GraphModule, log, gid: int) -> None:
    """An expert mask of top-k ids that leaves the graph (within a few casts, detaches and permutes):
    the per-expert loop continues in the next graph, cut at .nonzero(). One near-miss row and a
    warning per graph."""
    for node in gm.graph.nodes:
        ids = expert_ids(node)
        if ids is None:
            continue
        reach, frontier = set(), {node}
        for _ in range(6):
            frontier = {u for n in frontier for u in n.users} - reach
            reach |= frontier
        if any(n.op == "output" for n in reach):
            log.add(Decision(gid, core.LOOP_DESCRIPTOR.name, core.FAMILY, "near-miss", core.LOOP_ADVICE,
                             location(node), (describe(val(ids)),), kernel=core.KERNEL))
            warnings.warn(f"fusion_compiler: MoE experts not fused: {core.LOOP_ADVICE}", stacklevel=2)
            return


def _mask_ids(mask) -> fx.Node | None:
    """ids [T, k] for mask = one_hot(ids, E).permute(2, 1, 0) ([E, k, T], cast or not)."""
    source, dims = core._layout(mask)
    if dims != [2, 1, 0]:
        return None
    return expert_ids(source.args[0] if core._call(source, aten._to_copy.default) else source)


def _where(token) -> tuple | None:
    """(slot, mask [E, k, T], e) for token, slot = torch.where(mask[e])."""
    if not (core._call(token, operator.getitem) and token.args[1] == 1 and core._call(token.args[0], aten.unbind.int)):
        return None
    unbind = token.args[0]
    nonzero = unbind.args[0]
    if unbind.args[1:2] not in ((1,), (-1,)) or not core._call(nonzero, aten.nonzero.default):
        return None
    select = nonzero.args[0]
    if not (core._call(select, aten.select.int) and select.args[1] in (0, -3) and val(select.args[0]).dim() == 3):
        return None
    slots = [u for u in unbind.users if core._call(u, operator.getitem) and u.args[1] == 0]
    return (slots[0] if len(slots) == 1 else None), select.args[0], select.args[2] % val(select.args[0]).shape[0]


def _rows(rows, token) -> fx.Node | None:
    """x [T, D] for rows = x[token] or x[None, token].reshape(-1, D)."""
    if core._call(rows, *core._VIEWS):
        rows = rows.args[0]
        if core._call(rows, aten.index.Tensor) and list(rows.args[1]) == [None, token] and \
                core._call(rows.args[0], aten.unsqueeze.default) and rows.args[0].args[1] in (0, -3):
            return rows.args[0].args[0]
        return None
    if core._call(rows, aten.index.Tensor) and list(rows.args[1]) == [token]:
        return rows.args[0]
    return None


def _linear(node) -> tuple[fx.Node, fx.Node] | None:
    """(input, weight [N, K]) for node = F.linear(input, weight) without a bias (mm(input, weight.t()))."""
    if core._call(node, aten.mm.default) and core._call(node.args[1], aten.t.default):
        return node.args[0], node.args[1].args[0]
    return None


def _expert(y) -> tuple | None:
    """(rows, [w1, w3] or [w1], w2, act) for y = w2(act(w1 rows) * w3 rows) or w2(act(w1 rows))."""
    down = _linear(y)
    if down is None:
        return None
    h, w2 = down
    if core._call(h, aten.mul.Tensor):
        for gate, up in (h.args[:2], h.args[1::-1]):
            found = core._activation(gate)
            first, second = (_linear(found[1]), _linear(up)) if found else (None, None)
            if first and second and first[0] is second[0]:
                return first[0], [first[1], second[1]], w2, found[0]
        return None
    found = core._activation(h)
    first = _linear(found[1]) if found else None
    return (first[0], [first[1]], w2, found[0]) if first else None


def _scale(scale, token, slot) -> fx.Node | None:
    """weight [T, k] for scale = weight[token, slot, None] (or weight[token, slot].unsqueeze(-1))."""
    if core._call(scale, aten.index.Tensor) and list(scale.args[1]) == [token, slot] and \
            core._call(scale.args[0], aten.unsqueeze.default) and scale.args[0].args[1] in (-1, 2):
        return scale.args[0].args[0]
    if core._call(scale, aten.unsqueeze.default) and scale.args[1] in (-1, 1) and core._call(
            scale.args[0], aten.index.Tensor) and list(scale.args[0].args[1]) == [token, slot]:
        return scale.args[0].args[0]
    return None


def _link(node) -> dict | None:
    """One iteration: final = index_add(previous, 0, token, (expert(x[token]) * weight[...]).to(...))."""
    if not (core._call(node, aten.index_add.default) and node.args[1] == 0 and node.kwargs.get("alpha", 1) == 1
            and len(node.args) == 4):
        return None
    previous, token, src = node.args[0], node.args[2], node.args[3]
    where = _where(token)
    src = src.args[0] if is_float_cast(src) else src
    if where is None or where[0] is None or not core._call(src, aten.mul.Tensor):
        return None
    slot, mask, e = where
    for y, scale in (src.args[:2], src.args[1::-1]):
        weight, expert = _scale(scale, token, slot), _expert(y)
        if weight is not None and expert is not None and _rows(expert[0], token) is not None:
            return dict(previous=previous, mask=mask, e=e, weight=weight, x=_rows(expert[0], token),
                        ups=expert[1], down=expert[2], act=expert[3])
    return None


def _zeros(node) -> bool:
    return core._call(node, aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default) or \
        (core._call(node, aten.full.default) and node.args[1] == 0)


def find(last: fx.Node) -> "core.Experts | str | None":
    """The loop whose last index_add is `last` (a link that feeds another is not the end)."""
    if any(core._call(u, aten.index_add.default) and u.args[0] is last for u in last.users):
        return None
    links, node = [], last
    while (link := _link(node)) is not None:
        links.append(link)
        node = link["previous"]
    if not links or not _zeros(node) or list(val(node).shape) != list(val(links[0]["x"]).shape):
        return None
    first = links[0]
    ids = _mask_ids(first["mask"])
    experts = val(first["mask"]).shape[0]
    same = all(link[key] is first[key] for link in links for key in ("mask", "weight", "x")) and \
        len({link["act"] for link in links}) == 1 and len({len(link["ups"]) for link in links}) == 1
    if ids is None or not same or sorted(link["e"] for link in links) != list(range(experts)):
        return None  # not every expert once (a loop over the experts hit is data-dependent: not captured)
    links.sort(key=lambda link: link["e"])
    groups = [[link["ups"][i] for link in links] for i in range(len(first["ups"]))] + [[link["down"] for link in links]]
    if any(len({tuple(val(w).shape) for w in group}) != 1 for group in groups):  # (2-D: mm operands)
        return "the experts' weights differ in shape"
    layout = "separate" if len(first["ups"]) == 2 else "up"
    ex = core._experts(first["x"], ids, first["weight"], groups, layout, False, first["act"], last,
                       "per-expert loop (ModuleList, torch.where + index_add_)")
    if isinstance(ex, str):
        return ex
    ex.stacked = True
    return ex
