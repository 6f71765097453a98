"""MoE family: routed experts become one fusion::moe_experts call (grouped GEMMs over expert-sorted rows).

    before (HF transformers 5.x, experts_implementation="grouped_mm", the default):
        perm = sort(index.view(-1)).indices;  rows = x[perm // k];  offs = cumsum(histc(sorted ids))
        a = grouped_mm(rows, w_gate_up^T, offs);  h = act(a[:, :F]) * a[:, F:]
        y = grouped_mm(h, w_down^T, offs) * weight.view(-1)[perm, None]
        out = y[inverse(perm)].view(T, k, D).sum(1).to(x.dtype)
      (bf16: aten._grouped_mm; other dtypes: HF's transformers::grouped_mm_fallback op)
    before (torchtitan's MoE, its grouped_mm path without padding):
        perm = argsort(index.view(-1)); rows = torch.gather(x, 0, (perm // k).view(-1, 1).expand(-1, D))
        [rows = (rows.float() * weight.view(-1)[perm].view(-1, 1)).to(x.dtype)]        (score before)
        h = silu(grouped_mm(rows, w1^T)) * grouped_mm(rows, w3^T); y = grouped_mm(h, w2^T)
        [y = (y.float() * weight.view(-1)[perm].view(-1, 1)).to(x.dtype)]              (score after)
        out = (shared(x) or zeros_like(x)).scatter_add(0, token index, y)
    before (experts_implementation="batched_mm"):
        rows = x.repeat_interleave(k);  a = bmm(w_gate_up[index.view(-1)], rows[..., None]) ...
        out = (y * weight.view(-1, 1)).view(T, k, D).sum(1)
    before (the dense spelling, every expert on every token weighted by top-k gates): patterns/moe_dense.py
    after:
        out = fusion.moe_experts(x, index, weight, [w_gate_up, w_down], layout, act, impl)[0]

With the weight on the experts' input the op runs `scale_input` (grouped_mm path only). A shared
expert's output that the routed rows are scattered into is added to the op's output.
The router (linear, softmax or sigmoid, top-k, renormalisation) stays in the graph, where Inductor
fuses it; its top-k indices and weights are the op's inputs, so aux losses on the router logits are
untouched. Gated (SwiGLU / GeGLU) and ungated experts; weights stored [E, 2F, D] or transposed.
`impl` is chosen per shape by cost.estimate_moe between the generated Triton kernels (rows gathered
in the kernel, no permuted copies; the routing weight and the scatter in the down projection's
epilogue) and torch's grouped_mm; the row records the choice and both estimates.

A graph that returns a one-hot expert mask of [T, k] expert ids is the per-expert loop (HF's
experts_implementation="eager", transformers 4.x) broken at `.nonzero()`: it gets a near-miss row and
a warning naming the setting that keeps the MoE in one graph.
"""
import dataclasses
import operator
import types
import warnings

import torch
import torch.fx as fx

from fusion_compiler import cost
from fusion_compiler.canonical import is_float_cast, val
from fusion_compiler.codegen.launch import can_launch
from fusion_compiler.decisions import Decision, describe, location
from fusion_compiler.ops import moe as moe_op
from fusion_compiler.patterns import moe_dense, moe_loop
from fusion_compiler.patterns.checks import float_dtype, one_device

FAMILY = "moe"
DESCRIPTOR = types.SimpleNamespace(name="moe_experts", family=FAMILY)
LOOP_DESCRIPTOR = types.SimpleNamespace(name="moe_loop_graph_break", family=FAMILY)
DESCRIPTORS = (DESCRIPTOR, LOOP_DESCRIPTOR)
KERNEL = "fusion::moe_experts"
aten = torch.ops.aten
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
LOOP_ADVICE = ("the per-expert loop breaks the graph at .nonzero() (a loop over the experts hit depends on the "
               "data); build the HF model with experts_implementation='grouped_mm' (the transformers 5.x default) "
               "so the MoE stays in one graph; a loop over range(num_experts) (transformers 4.x) is one graph "
               "when compiled with fusion_compiler.compile(model) (or with "
               "torch._dynamo.config.capture_dynamic_output_shape_ops = True)")


@dataclasses.dataclass
class Experts:
    x: fx.Node  # [T, D]
    index: fx.Node  # [T, k] expert ids
    weight: fx.Node  # [T, k] routing weights
    weights: list  # stored expert weights, as `layout` says
    layout: str
    act: str
    out: fx.Node  # the node the op's output replaces
    views: list  # shapes of the views between the experts' sum and `out`
    spelling: str
    base: fx.Node | None = None  # what the experts' sum is added to (a shared expert's output), if anything
    scale_input: bool = False  # the routing weight scales the experts' input (torchtitan), not their output
    stops: tuple = ()  # other nodes the region ends at (what the dense gates' zeros were shaped like)
    stacked: bool = False  # weights holds per-expert lists (a ModuleList's), stacked to [E, ...] by the rewrite


def weight_nodes(ex: Experts) -> list:
    return [w for group in ex.weights for w in group] if ex.stacked else list(ex.weights)


def weight_vals(ex: Experts) -> list:
    """The op's weight operands' fake values ([E, ...] stacks of a ModuleList's weights)."""
    if ex.stacked:
        return [torch.stack([val(w) for w in group]) for group in ex.weights]
    return [val(w) for w in ex.weights]


def _call(node, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _grouped(node) -> bool:
    """aten._grouped_mm, or HF's custom-op fallback for dtypes grouped_mm does not take."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    if node.target is aten._grouped_mm.default:
        return len(node.args) < 4 or all(a is None for a in node.args[3:])  # no bias, default out dtype
    name = getattr(node.target, "name", None)
    return callable(name) and name() == "transformers::grouped_mm_fallback"


def _through(node, targets):
    """Skip one node of `targets` (a view, a same-dtype cast) when present."""
    return node.args[0] if _call(node, *targets) else node


def _unmask(node, experts: int, sorts: list):
    """src for node = src.masked_fill((sorted ids >= experts)[:, None], 0) (HF's expert-parallel
    sentinel rows, none with top-k ids of this rank; the op leaves such rows out too), else node.
    The sort the ids come from is appended to `sorts` (it must be the dispatch's)."""
    if not (_call(node, aten.masked_fill.Scalar) and node.args[2] == 0):
        return node
    mask = node.args[1]
    ge = mask.args[0] if _call(mask, aten.unsqueeze.default) and mask.args[1] in (-1, 1) else None
    if not (_call(ge, aten.ge.Scalar) and ge.args[1] == experts and _call(ge.args[0], operator.getitem)
            and ge.args[0].args[1] == 0):
        return node
    sorts.append(ge.args[0].args[0])
    return node.args[0]


def _activation(node) -> tuple[str, fx.Node] | None:
    """(act, its input) of silu / gelu / gelu(tanh) at node."""
    if _call(node, aten.silu.default):
        return "silu", node.args[0]
    if _call(node, aten.gelu.default):
        return ("gelu_tanh" if node.kwargs.get("approximate", "none") == "tanh" else "gelu"), node.args[0]
    return None


def _halves(a, b):
    """(first, both's source) when a, b are getitem 0 and 1 of one split/chunk of the last dim in two."""
    if not (_call(a, operator.getitem) and _call(b, operator.getitem) and a.args[0] is b.args[0]):
        return None
    split = a.args[0]
    if not _call(split, aten.split.Tensor) or (a.args[1], b.args[1]) != (0, 1):
        return None
    source = split.args[0]
    if split.args[2] not in (-1, val(source).dim() - 1) or val(source).shape[-1] != 2 * split.args[1]:
        return None
    return source


def _expert_mlp(h) -> tuple[list, str, bool] | None:
    """([the up projection node(s)], act, gated) of h = act(gate) * up or act(up): gate and up the
    halves of one product's output, or two products (gate first)."""
    if _call(h, aten.mul.Tensor):
        for a, b in (h.args[:2], h.args[1::-1]):
            found = _activation(a)
            if found is not None:
                source = _halves(found[1], b)
                if source is not None:
                    return [source], found[0], True
                if _grouped(found[1]) and _grouped(b):
                    return [found[1], b], found[0], True
        return None
    found = _activation(h)
    return ([found[1]], found[0], False) if found else None


def _stored(b) -> tuple[fx.Node, bool] | None:
    """(the stored weight, transposed) of a grouped-mm right operand: w.transpose(-2, -1) reads a
    weight stored [E, N, K]; a 3-D weight used as is is stored [E, K, N] (transposed)."""
    if _call(b, aten.transpose.int) and sorted(b.args[1:]) == [-2, -1] and val(b).dim() == 3:
        return b.args[0], False
    if _call(b, aten.transpose.int, aten.permute.default) and _layout(b)[1] == [0, 2, 1]:
        return _layout(b)[0], False
    return (b, True) if isinstance(b, fx.Node) and val(b) is not None and val(b).dim() == 3 else None


def _flat(node) -> fx.Node | None:
    """The [T, k] tensor that node views as [-1]."""
    if _call(node, *_VIEWS) and val(node).dim() == 1 and val(node.args[0]).dim() == 2:
        return node.args[0]
    return None


def _expanded_token(index) -> fx.Node | None:
    """token for index = token.view(-1, 1).expand(-1, D) (a gather's or scatter's row index)."""
    if _call(index, aten.expand.default):
        column = index.args[0]
        if _call(column, *_VIEWS) and list(val(column).shape)[1:] == [1]:
            return column.args[0]
    return None


def _gathered_token(rows) -> tuple[fx.Node, fx.Node] | None:
    """(x, token) for rows = x[token] or torch.gather(x, 0, token.view(-1, 1).expand(-1, D))."""
    if _call(rows, aten.index.Tensor) and len(rows.args[1]) == 1:
        return rows.args[0], rows.args[1][0]
    if _call(rows, aten.gather.default) and rows.args[1] == 0 and _expanded_token(rows.args[2]) is not None:
        return rows.args[0], _expanded_token(rows.args[2])
    return None


def _scaled_rows(rows) -> tuple[fx.Node, fx.Node] | None:
    """(unscaled rows, the flat-weight gather node) for (rows.float() * weight.view(-1)[perm].view(-1, 1))
    cast back: the routing weight applied to the experts' input."""
    if not (is_float_cast(rows) and _call(rows.args[0], aten.mul.Tensor)):
        return None
    for a, b in (rows.args[0].args[:2], rows.args[0].args[1::-1]):
        scale = b.args[0] if _call(b, *_VIEWS, aten.unsqueeze.default) and val(b).dim() == 2 else None
        if is_float_cast(a) and _call(scale, aten.index.Tensor):
            return a.args[0], scale
    return None


def _sorted_dispatch(rows, offs) -> tuple | None:
    """(x, index [T, k], perm, k) for rows = x[perm // k] with perm sorting index.view(-1) and offs
    its cumulative per-expert counts."""
    rows = _through(rows, (aten._to_copy.default,))
    found = _gathered_token(rows)
    if found is None:
        return None
    x, token = found
    if not (_call(token, aten.floor_divide.default, aten.div.Tensor_mode) and isinstance(token.args[1], int)):
        return None
    perm, k = token.args[0], token.args[1]
    if not (_call(perm, operator.getitem) and perm.args[1] == 1 and _call(perm.args[0], aten.sort.default,
                                                                           aten.sort.stable)):
        return None
    sort = perm.args[0]
    index = _flat(sort.args[0])
    if index is None or val(index).shape[1] != k or val(x).dim() != 2:
        return None
    # offs = cumsum(histc(ids, bins=E, min=0, max=E-1 or E)) or cumsum(bincount(ids)), ids sorted or not
    if not _call(offs, aten.cumsum.default):
        return None
    counts = offs.args[0]
    source = _through(counts.args[0], (aten._to_copy.default,)) if _call(
        counts, aten.histc.default, aten.bincount.default) else None
    sorted_ids = _call(source, operator.getitem) and source.args[0] is sort and source.args[1] == 0
    if not (sorted_ids or _flat(source) is index):
        return None
    if counts.target is aten.histc.default and (list(counts.args[2:4]) not in ([0, counts.args[1] - 1],
                                                                               [0, counts.args[1]])):
        return None  # bins other than one per expert id
    return x, index, perm, k


def _sorted_combine(y, perm, k, experts: int, sorts: list) -> tuple[fx.Node, fx.Node] | None:
    """(weight [T, k], the [T, D] sum) for sum_j of (y * weight.view(-1)[perm, None])[inverse perm]
    viewed [T, k, D] (y's sentinel rows zeroed first or not)."""
    masked = _single_user(y)
    if masked is not None and _unmask(masked, experts, sorts) is y:
        y = masked
    users = list(y.users)
    if len(users) != 1 or not _call(users[0], aten.mul.Tensor):
        return None
    mul = users[0]
    scale = mul.args[1] if mul.args[0] is y else mul.args[0]
    scale = scale.args[0] if _call(scale, aten.unsqueeze.default) and scale.args[1] in (-1, 1) else None
    if not (_call(scale, aten.index.Tensor) and scale.args[1] == [perm]):
        return None
    weight = _flat(scale.args[0])
    back = _single_user(mul)
    if weight is None or not (_call(back, aten.index.Tensor) and len(back.args[1]) == 1):
        return None
    inverse = back.args[1][0]  # inverse[perm] = arange(S)
    if not (_call(inverse, aten.index_put.default) and inverse.args[1] == [perm]
            and _call(inverse.args[2], aten.arange.default, aten.arange.start)):
        return None
    return weight, _slot_sum(_single_user(back), k)


def _single_user(node):
    users = list(node.users) if isinstance(node, fx.Node) else []
    return users[0] if len(users) == 1 else None


def _slot_sum(view, k) -> fx.Node | None:
    """The sum over k of view = rows viewed [T, k, D]."""
    if not (_call(view, *_VIEWS) and val(view).dim() == 3 and val(view).shape[1] == k):
        return None
    total = _single_user(view)
    if _call(total, aten.sum.dim_IntList) and list(total.args[1]) in ([1], [-2]) and not (
            total.args[2:] and total.args[2]) and total.kwargs.get("dtype") is None:
        return total
    return None


def _ending(total: fx.Node, x: fx.Node) -> tuple[fx.Node, list] | str:
    """(the node to replace, the view shapes on the way) after the experts' sum: views, then a cast to
    x's dtype when the sum ran in a wider one."""
    node, shapes = total, []
    while True:
        nxt = _single_user(node)
        if _call(nxt, *_VIEWS):
            node = nxt
            shapes.append(list(val(node).shape))
        elif is_float_cast(nxt) and val(nxt).dtype == val(x).dtype and val(node).dtype != val(x).dtype:
            node = nxt
        else:
            break
    if val(node).dtype != val(x).dtype:
        return (f"the experts' sum is returned in {val(node).dtype} while x is {val(x).dtype}: the op returns "
                "x's dtype")
    return node, shapes


def _grouped_spelling(down: fx.Node) -> Experts | str | None:
    h, b_down, offs = down.args[:3]
    stored_down = _stored(b_down)
    mlp = _expert_mlp(_through(h, (aten._to_copy.default,)))
    if stored_down is None or mlp is None:
        return None
    experts, sorts = val(stored_down[0]).shape[0], []
    sources, act, gated = mlp
    ups = [_unmask(source, experts, sorts) for source in sources]
    rows = ups[0].args[0] if _grouped(ups[0]) else None
    if not all(_grouped(up) and up.args[2] is offs and up.args[0] is rows for up in ups):
        return None
    stored_ups = [_stored(up.args[1]) for up in ups]
    rows = _unmask(rows, experts, sorts)
    scaled = _scaled_rows(rows)
    dispatch = _sorted_dispatch(scaled[0] if scaled else rows, offs)
    if any(st is None for st in stored_ups) or dispatch is None:
        return None
    x, index, perm, k = dispatch
    spelling = "torchtitan (gather, scatter_add)"
    if scaled:
        combine = _scattered_combine(down, perm, rows_scaled=True)
        flat = scaled[1]
        if combine is None or combine[0] is not None or flat.args[1] != [perm] or _flat(flat.args[0]) is None:
            return None
        weight, (_, total, base) = _flat(flat.args[0]), combine
    else:
        combine = _sorted_combine(down, perm, k, experts, sorts)
        if combine is not None:
            spelling = "grouped_mm"
        else:
            combine = _scattered_combine(down, perm, rows_scaled=False)
        if combine is None or combine[1] is None or combine[0] is None:
            return None
        weight, total, base = (*combine, None)[:3]
    if any(sort is not perm.args[0] for sort in sorts):
        return None
    if len({st[1] for st in stored_ups} | {stored_down[1]}) != 1:
        return "gate/up and down weights are stored in different orientations"
    layout = ("gate_up" if gated else "up") if len(ups) == 1 else "separate"
    return _experts(x, index, weight, [st[0] for st in stored_ups] + [stored_down[0]], layout, stored_down[1], act,
                    total, spelling, base=base, scale_input=bool(scaled))


def _scattered_combine(y, perm, rows_scaled: bool) -> tuple | None:
    """(weight [T, k] or None, the scatter_add, its base or None) for torchtitan's combine:
    base.scatter_add(0, token.view(-1, 1).expand(-1, D), rows), the rows being y (cast back to x's
    dtype) when the weight scaled the input, else (y.float() * weight.view(-1)[perm].view(-1, 1))
    cast back; base = zeros_like(x) (no base) or a shared expert's output."""
    node, weight = _single_user(y), None
    if is_float_cast(node):  # y.type_as(x) / y.to(float32)
        nxt = _single_user(node)
        if not rows_scaled and _call(nxt, aten.mul.Tensor):
            scale = nxt.args[1] if nxt.args[0] is node else nxt.args[0]
            scale = scale.args[0] if _call(scale, *_VIEWS) and val(scale).dim() == 2 else None
            if not (_call(scale, aten.index.Tensor) and scale.args[1] == [perm]) or not is_float_cast(
                    _single_user(nxt)):
                return None
            weight, node, nxt = _flat(scale.args[0]), _single_user(nxt), _single_user(_single_user(nxt))
        y, node = node, nxt
    elif not rows_scaled:
        return None
    scatter = node
    if not (_call(scatter, aten.scatter_add.default) and scatter.args[1] == 0 and scatter.args[3] is y):
        return None
    token = _expanded_token(scatter.args[2])
    if not (_call(token, aten.floor_divide.default, aten.div.Tensor_mode) and token.args[0] is perm):
        return None
    base = scatter.args[0]
    return weight, scatter, (None if _call(base, aten.zeros_like.default) else base)


def _experts(x, index, weight, weights, layout, transposed, act, total, spelling, base=None,
             scale_input=False, stops=()) -> Experts | str:
    ending = _ending(total, x)
    if isinstance(ending, str):
        return ending
    return Experts(x, index, weight, weights, layout + ("_t" if transposed else ""), act, ending[0], ending[1],
                   spelling, base, scale_input, stops)


# --- layouts ------------------------------------------------------------------------------------------
def _layout(node) -> tuple[fx.Node, list]:
    """(source, dims) for node = source.permute(dims) through transposes (.t() too) and permutes."""
    dims = list(range(val(node).dim())) if val(node) is not None else []
    while _call(node, aten.transpose.int, aten.permute.default, aten.t.default):
        n = len(dims)
        if node.target is not aten.permute.default:
            i, j = (d % n for d in node.args[1:3]) if node.target is aten.transpose.int else (0, n - 1)
            step = list(range(n))
            step[i], step[j] = j, i
        else:
            step = [d % n for d in node.args[1]]
        dims = [step[d] for d in dims]
        node = node.args[0]
    return node, dims


# --- batched_mm spelling -------------------------------------------------------------------------------
def _gathered_weight(node, ids) -> fx.Node | None:
    """w for node = w[ids] (each slot's expert weight)."""
    if _call(node, aten.index.Tensor) and node.args[1] == [ids] and val(node.args[0]).dim() == 3:
        return node.args[0]
    return None


def _repeated_rows(node, k) -> fx.Node | None:
    """x [T, D] for node = x.repeat_interleave(k, 0) (as make_fx decomposes it: unsqueeze, expand,
    clone, view)."""
    if not _call(node, *_VIEWS):
        return None
    src = _through(node.args[0], (aten.clone.default,))
    if not (_call(src, aten.expand.default) and val(src).dim() == 3 and val(src).shape[1] == k):
        return None
    base = src.args[0]
    if _call(base, aten.unsqueeze.default) and base.args[1] in (1, -2) and val(base.args[0]).dim() == 2:
        return base.args[0]
    return None


def _batched_product(node) -> tuple[fx.Node, fx.Node] | None:
    """(w[ids] node, vector rows) of squeeze(matmul/bmm(w[ids], rows.unsqueeze(-1)), -1)."""
    if not (_call(node, aten.squeeze.dim) and node.args[1] in (-1, 2)):
        return None
    mm = node.args[0]
    if not _call(mm, aten.matmul.default, aten.bmm.default):
        return None
    vec = mm.args[1]
    if not (_call(vec, aten.unsqueeze.default) and vec.args[1] in (-1, 2)):
        return None
    return mm.args[0], vec.args[0]


def _batched_spelling(squeeze: fx.Node) -> Experts | str | None:
    down = _batched_product(squeeze)
    if down is None or not _call(down[0], aten.index.Tensor):
        return None
    ids = down[0].args[1][0]
    w_down = _gathered_weight(down[0], ids)
    mlp = _expert_mlp(down[1])
    flat = ids
    if w_down is not None and _call(ids, aten.clamp.default) and list(ids.args[1:3]) == [0, val(w_down).shape[0] - 1]:
        flat = ids.args[0]  # HF 5.17 clamps expert-parallel sentinels into range (their weight is 0)
    index = _flat(flat)
    if w_down is None or mlp is None or index is None:
        return None
    up_nodes, act, gated = mlp
    up = _batched_product(up_nodes[0]) if len(up_nodes) == 1 else None
    if up is None:
        return None
    w_up = _gathered_weight(up[0], ids)
    k = val(index).shape[1]
    x = _repeated_rows(up[1], k)
    mul = _single_user(squeeze)
    if w_up is None or x is None or not _call(mul, aten.mul.Tensor):
        return None
    scale = mul.args[1] if mul.args[0] is squeeze else mul.args[0]
    scale = scale.args[0] if _call(scale, aten.unsqueeze.default) and scale.args[1] in (-1, 1) else None
    weight = _flat(scale) if scale is not None else None
    total = _slot_sum(_single_user(mul), k)
    if weight is None or total is None:
        return None
    return _experts(x, index, weight, [w_up, w_down], "gate_up" if gated else "up", False, act, total, "batched_mm")


# --- the pass -------------------------------------------------------------------------------------------
def find(node: fx.Node) -> Experts | str | None:
    """The experts region whose down projection is `node`, a reason it cannot be taken, or None."""
    if _grouped(node):
        return _grouped_spelling(node)
    if _call(node, aten.squeeze.dim):
        return _batched_spelling(node)
    if _call(node, aten.matmul.default) and val(node).dim() == 3:
        return moe_dense.find(node)
    if _call(node, aten.index_add.default):
        return moe_loop.find(node)
    return None


def _region(ex: Experts) -> set:
    """The nodes computing ex.out from its inputs (they die when ex.out is replaced)."""
    stop = {ex.x, ex.index, ex.weight, *weight_nodes(ex), *ex.stops} | ({ex.base} if ex.base is not None else set())
    region, todo = set(), [ex.out]
    while todo:
        node = todo.pop()
        if node in region or node in stop or node.op != "call_function":
            continue
        region.add(node)
        todo.extend(n for n in node.all_input_nodes)
    return region


def _dead_mutations(region: set) -> list:
    """In-place ops on region values whose results nobody reads (HF 5.17's expert_ids.clamp_ after the
    sort): they die with the region."""
    return [user for node in region for user in node.users
            if user not in region and not user.users and user.op == "call_function"
            and getattr(getattr(user.target, "_schema", None), "is_mutable", False) and user.args[0] is node]


_SIZE_CHECKS = (aten.sym_size.int, aten._assert_scalar.default, operator.ge, operator.le, operator.lt, operator.gt,
                operator.eq)


def _size_checks(region: set) -> list:
    """The runtime checks Dynamo adds on a data-dependent size of a region value (sym_size -> ge/le ->
    _assert_scalar, kept by dead-code elimination as side effects): they die with the region. In
    reverse order (each node before its inputs)."""
    checks, todo = [], [u for n in region for u in n.users if u not in region and _call(u, *_SIZE_CHECKS)]
    while todo:
        node = todo.pop()
        if node in checks or not _call(node, *_SIZE_CHECKS):
            continue
        checks.append(node)
        todo.extend(node.users)
    checked = set(checks)
    if any(u not in checked and u not in region for n in checks for u in n.users):
        return []  # a size read by something else: the region cannot go
    order = {n: i for i, n in enumerate(next(iter(region)).graph.nodes)} if region else {}
    return sorted(checks, key=order.__getitem__, reverse=True)


def _escape(ex: Experts, region: set) -> str | None:
    dead = set(_dead_mutations(region)) | set(_size_checks(region))
    for node in region:
        if node is ex.out:
            continue
        for user in node.users:
            if user not in region and user not in dead:
                where = location(user)
                return f"intermediate {node.name} is also used by {user.name}" + (f" ({where})" if where else "")
    return None


def _legal(ex: Experts, region: set) -> str | None:
    x, index, weight = val(ex.x), val(ex.index), val(ex.weight)
    weights = weight_vals(ex)
    why = one_device([x, index, weight, *weights]) or float_dtype(x) or float_dtype(weight)
    if why:
        return why
    if any(w.dtype != x.dtype for w in weights):
        return f"expert weights {[str(w.dtype) for w in weights]} differ from x's {x.dtype}"
    if any(isinstance(s, torch.SymInt) for t in (x, index, *weights) for s in t.shape):
        return "symbolic (dynamic) sizes: the region keeps its graph"
    if x.numel() == 0:
        return "no tokens"
    try:
        moe_op.check(x, index, weight, weights, ex.layout, ex.act)
    except ValueError as e:
        return str(e)
    if can_launch(x.device) and not _grouped_mm_runs(ex):
        return f"{can_launch(x.device)}; and grouped_mm cannot run these operands"
    return None


def _grouped_mm_runs(ex: Experts) -> bool:
    return moe_op.resolve_impl("grouped_mm", val(ex.x), ex.layout, weight_vals(ex)) == "grouped_mm"


def _shape(ex: Experts) -> dict:
    x, index = val(ex.x), val(ex.index)
    w_gate, w_up, _ = moe_op.views(ex.layout, weight_vals(ex))
    return dict(tokens=x.shape[0], top_k=index.shape[1], width=x.shape[1], ffn=w_gate.shape[1],
                experts=w_gate.shape[0], gated=w_up is not None, dtype=x.dtype, spelling=ex.spelling.split(" ")[0],
                separate=moe_op.parse_layout(ex.layout)[0] == "separate", scale_input=ex.scale_input,
                stacked_bytes=sum(w.numel() * w.element_size() for w in weight_vals(ex)) if ex.stacked else 0)


def rewrite(gm: fx.GraphModule, config, log, gid: int, needs_grad: set) -> int:
    """Replace every routed-experts region that is legal and pays; one decision row each."""
    applied = 0
    if config.enables(LOOP_DESCRIPTOR):
        moe_loop.report_breaks(gm, log, gid)
    if not config.enables(DESCRIPTOR):
        return 0
    for node in list(gm.graph.nodes):
        if node.graph is not gm.graph:
            continue  # erased by an earlier rewrite
        ex = find(node)
        if ex is None:
            continue
        if isinstance(ex, str):
            log.add(Decision(gid, DESCRIPTOR.name, FAMILY, "near-miss", ex, location(node), (), kernel=KERNEL))
            continue
        row, done = _decide(gm, ex, config, gid, needs_grad)
        log.add(row)
        applied += done
    if applied:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return applied


def _row(gid, ex: Experts, verdict: str, reason: str, estimate=None) -> Decision:
    inputs = [val(ex.x), val(ex.index), val(ex.weight), *weight_vals(ex)]
    return Decision(gid, DESCRIPTOR.name, FAMILY, verdict, f"{ex.spelling} spelling, {ex.layout}, {ex.act}: {reason}",
                    location(ex.out), tuple(describe(v) for v in inputs),
                    bytes_saved=estimate.bytes_saved if estimate else None,
                    time_saved_us=round(estimate.time_saved_s * 1e6, 2) if estimate else None, kernel=KERNEL)


def _decide(gm, ex: Experts, config, gid, needs_grad) -> tuple[Decision, int]:
    region = _region(ex)
    why = _escape(ex, region)
    if why:
        return _row(gid, ex, "near-miss", why), 0
    why = _legal(ex, region)
    if why:
        return _row(gid, ex, "rejected", why), 0
    x = val(ex.x)
    training = ex.out in needs_grad
    ctx = cost.CostContext.of(x.device, config, training)
    options = {}
    if can_launch(x.device) is None and not ex.scale_input:  # the Triton kernels weight the output
        options["triton"] = cost.estimate_moe(_shape(ex), "triton", ctx)
    if _grouped_mm_runs(ex):
        options["grouped_mm"] = cost.estimate_moe(_shape(ex), "grouped_mm", ctx)
    if not options:
        return _row(gid, ex, "rejected", "the routing weight scales the experts' input: grouped_mm path only, and "
                    "grouped_mm cannot run these operands (bf16 on CUDA, 16-byte aligned strides)"), 0
    impl = config.moe_impl if config.moe_impl in options else min(options, key=lambda i: options[i].ours_s)
    estimate = cost.with_host_time(options[impl], 2 if training else 1, ctx)  # fusion::moe_experts, its backward
    others = "; ".join(f"{name}: est. {e.ours_s * 1e6:.1f} us" for name, e in options.items() if name != impl)
    choice = f"impl {impl}" + (f" (over {others})" if others else "")
    if config.cost_model == "roofline" and not estimate.profitable:
        return _row(gid, ex, "rejected", f"{choice}; {estimate.reason()}", estimate), 0
    for node in _dead_mutations(region) + _size_checks(region):
        gm.graph.erase_node(node)
    _replace(gm, ex, impl)
    reason = estimate.reason() if config.cost_model == "roofline" else \
        f"cost model off (cost_model='always'); {estimate.reason()}"
    return _row(gid, ex, "applied", f"{choice}; {reason}", estimate), 1


def _replace(gm: fx.GraphModule, ex: Experts, impl: str) -> None:
    graph = gm.graph
    values = weight_vals(ex)
    with graph.inserting_before(ex.out):
        weights = list(ex.weights)
        if ex.stacked:  # a ModuleList's weights, one [E, ...] tensor each (one copy; autograd splits the gradient)
            weights = [graph.call_function(aten.stack.default, (group,)) for group in ex.weights]
            for node, value in zip(weights, values):
                node.meta["val"] = value
        args = (ex.x, ex.index, ex.weight, weights, ex.layout, ex.act, impl, ex.scale_input)
        call = graph.call_function(torch.ops.fusion.moe_experts.default, args)
        out = graph.call_function(operator.getitem, (call, 0))
        nodes = [call, out]
        if ex.base is not None:  # the shared expert's output the experts were scattered into
            out = graph.call_function(aten.add.Tensor, (ex.base, out))
            nodes.append(out)
        for shape in ex.views:
            out = graph.call_function(aten.view.default, (out, shape))
            nodes.append(out)
    # the op's own fake kernel gives its outputs' values (the operands' values are fake tensors)
    call.meta["val"] = torch.ops.fusion.moe_experts.default(val(ex.x), val(ex.index), val(ex.weight), values,
                                                             ex.layout, ex.act, impl, ex.scale_input)
    current = call.meta["val"][0]
    nodes[1].meta["val"] = current
    if ex.base is not None:
        nodes[2].meta["val"] = current = current + val(ex.base)
    for node, shape in zip(nodes[3 if ex.base is not None else 2:], ex.views):
        current = current.view(shape)
        node.meta["val"] = current
    for node in nodes:
        if "stack_trace" in ex.out.meta:
            node.meta["stack_trace"] = ex.out.meta["stack_trace"]
    ex.out.replace_all_uses_with(out)
