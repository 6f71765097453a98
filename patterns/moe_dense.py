"""MoE family, the dense spelling: every expert on every token, weighted by gates zero outside the top k.

    gates = zeros_like(probs).scatter(1, index, weight)                       (index from topk)
    h = act(einsum("td,edf->tef", x, w_gate)) * einsum("td,edf->tef", x, w_up)
    out = einsum("ted,te->td", einsum("tef,efd->ted", h, w_down), gates)   (or (y * gates[..., None]).sum(1))

with x [T, D]; the products as einsum ([T, E, F] or [E, T, F] order), or bmm over x expanded to
[E, T, D]; gate and up as two weights or the halves of one; weights stored [E, D, F] or [E, F, D].
canonical.einsum_as_matmul turns each einsum into a (broadcast) matmul, so every spelling reads
matmul(x expanded, w) here. The region becomes the routed op of patterns/moe.py: only the top-k
(token, expert) pairs are computed, the same result with E / k times fewer FLOPs (an unrouted
expert's inf or NaN, which eager multiplies by 0 into a NaN, is never computed).
"""
import operator

import torch
import torch.fx as fx

from fusion_compiler.canonical import is_float_cast, val
from fusion_compiler.patterns import moe as core

aten = torch.ops.aten


def _all_experts_product(node, experts_first: list) -> tuple[fx.Node, fx.Node] | None:
    """(x [T, D], b) for node = permute(matmul(x expanded to [E, T, D], b), dims) whose dims put it
    back in [E, T, N] order when `experts_first` is applied after them."""
    product, dims = core._layout(node)
    if [dims[d] for d in experts_first] != [0, 1, 2] or not core._call(product, aten.matmul.default):
        return None
    a, b = product.args[:2]
    if not (core._call(a, aten.expand.default) and val(a).dim() == 3):
        return None
    x = a.args[0]
    if core._call(x, aten.unsqueeze.default) and x.args[1] in (0, -3):
        x = x.args[0]
    if val(x).dim() != 2 or val(b).dim() != 3 or val(b).shape[0] != val(a).shape[0]:
        return None
    return x, b


def _dense_mlp(a) -> tuple | None:
    """(x, [up products' right operands], act, gated) for a = h in [E, T, F] order, h = act(gate) * up
    or act(up), each an all-experts product of x (gate and up as two products, or the halves of one)."""
    h, dims = core._layout(a)
    back = [dims.index(d) for d in range(3)]  # h's dims in [E, T, F] order
    if core._call(h, aten.mul.Tensor):
        for gate, up in (h.args[:2], h.args[1::-1]):
            found = core._activation(gate)
            if found is None:
                continue
            source = core._halves(found[1], up)
            parts = [source] if source is not None else [found[1], up]
            products = [_all_experts_product(part, back) for part in parts]
            if all(products) and len({x for x, _ in products}) == 1:
                return products[0][0], [b for _, b in products], found[0], True
        return None
    found = core._activation(h)
    product = _all_experts_product(found[1], back) if found else None
    return (product[0], [product[1]], found[0], False) if product else None


def _dense_gates(gates) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(index [T, k] from topk, weight [T, k], what the zeros were shaped like) for gates =
    zeros.scatter(1, index, weight), cast or not."""
    gates = gates.args[0] if is_float_cast(gates) else gates
    if not (core._call(gates, aten.scatter.src) and gates.args[1] in (1, -1)):
        return None
    zeros, index, weight = gates.args[0], gates.args[2], gates.args[3]
    if core._call(zeros, aten.zeros_like.default, aten.new_zeros.default):
        like = (zeros.args[0],)
    elif core._call(zeros, aten.zeros.default) or (core._call(zeros, aten.full.default) and zeros.args[1] == 0):
        like = ()
    else:
        return None
    from_topk = core._call(index, operator.getitem) and index.args[1] == 1 and \
        core._call(index.args[0], aten.topk.default)
    if not from_topk or val(weight).shape != val(index).shape or val(index).dim() != 2:
        return None
    return index, weight, like


def _unit_last(node) -> fx.Node | None:
    """t for node = t.unsqueeze(-1) (or a view adding a last unit dim)."""
    if core._call(node, aten.unsqueeze.default) and node.args[1] in (-1, val(node).dim() - 1):
        return node.args[0]
    if core._call(node, *core._VIEWS) and list(val(node).shape) == [*val(node.args[0]).shape, 1]:
        return node.args[0]
    return None


def _dense_combine(y) -> tuple[fx.Node, fx.Node] | None:
    """(gates [T, E], the [T, D] sum) for sum_e y[e, t] * gates[t, e] with y [E, T, D]: as a matmul
    of y in [T, D, E] order with gates[..., None], or a product with the gates broadcast and a sum."""
    node = y
    while core._call(core._single_user(node), aten.transpose.int, aten.permute.default):
        node = core._single_user(node)
    dims = core._layout(node)[1]
    user = core._single_user(node)
    if core._call(user, aten.matmul.default) and user.args[0] is node and dims == [1, 2, 0]:
        gates, total = _unit_last(user.args[1]), core._single_user(user)
        if core._call(total, aten.squeeze.dim) and total.args[1] in (-1, 2) or \
                core._call(total, *core._VIEWS) and list(val(total).shape) == list(val(total.args[0]).shape[:2]):
            return (gates, total) if gates is not None else None
        return None
    if not core._call(user, aten.mul.Tensor):
        return None
    other = _unit_last(user.args[1] if user.args[0] is node else user.args[0])
    total = core._single_user(user)
    if other is None or not (core._call(total, aten.sum.dim_IntList) and len(total.args[1]) == 1) or \
            (total.args[2:] and total.args[2]) or total.kwargs.get("dtype") is not None:
        return None
    summed = total.args[1][0] % 3
    if dims == [1, 0, 2] and summed == 1:  # y as [T, E, D], gates [T, E]
        return other, total
    gates, g_dims = core._layout(other)
    if dims == [0, 1, 2] and summed == 0 and g_dims == [1, 0]:  # y as [E, T, D], gates.t()
        return gates, total
    return None


def find(down: fx.Node) -> "core.Experts | str | None":
    stored_down = core._stored(down.args[1])
    mlp = _dense_mlp(down.args[0]) if stored_down is not None else None
    combine = _dense_combine(down) if mlp is not None else None
    gates = _dense_gates(combine[0]) if combine is not None else None
    if gates is None:
        return None
    x, ups, act, gated = mlp
    stored_ups = [core._stored(b) for b in ups]
    index, weight, like = gates
    experts = val(stored_down[0]).shape[0]
    if any(st is None for st in stored_ups) or list(val(combine[0]).shape) != [val(x).shape[0], experts]:
        return None
    if len({st[1] for st in stored_ups} | {stored_down[1]}) != 1:
        return "gate/up and down weights are stored in different orientations"
    layout = ("gate_up" if gated else "up") if len(ups) == 1 else "separate"
    return core._experts(x, index, weight, [st[0] for st in stored_ups] + [stored_down[0]], layout, stored_down[1],
                         act, combine[1], "dense (all experts, top-k gates)", stops=like)


