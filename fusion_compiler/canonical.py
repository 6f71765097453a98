"""Many spellings, one form.

`to_aten` re-traces Dynamo's torch-level graph into ATen ops on fake tensors: the dispatcher already
maps x.softmax(-1) / torch.softmax / F.softmax, x.pow(2) / x ** 2 / torch.square ... to one ATen op.
`canonicalize` then rewrites what the dispatcher leaves spelled several ways:
    defaults filled in from the op schema          gelu(x) == gelu(x, approximate='none')
    in-place ops on private intermediates          add_(t, eps) -> add(t, eps)
    Scalar overloads                               mul.Scalar -> mul.Tensor
    non-negative dims                              mean(x, [2]) on 3-D x -> mean(x, [-1])
    transpose dims ordered                         x.transpose(-1, -2) -> x.transpose(-2, -1)
    a permute swapping two dims is a transpose     x.permute(0, 1, 3, 2) -> x.transpose(-2, -1)
    slice bounds clamped                           slice(x, -1, 0, 2**63-1) -> slice(x, -1, 0, size)
    x * x -> x ** 2;  1 / sqrt(v), reciprocal(sqrt(v)) -> rsqrt(v);  a / sqrt(v) -> a * rsqrt(v)
    x * sigmoid(x) -> silu(x)
    where(keep, x, c) -> x.masked_fill(~keep, c)    (a scalar c: torch.where spelling of a mask)
    einsum as matmul                               einsum("bhqd,bhkd->bhqk", q, k) -> q @ k^T
    a scalar factor after the matmul               (q * c) @ k^T -> (q @ k^T) * c
    casts, scalar pointwise ops after views        view(x.float()) -> view(x).float(); view(x / c) -> view(x) / c
    view chains collapsed                          view(view(x, s1), s2) -> view(x, s2); to x's shape -> x
    matmul re-composed                             the expand/clone/view -> bmm -> view chain that
                                                   make_fx leaves for a batched a @ b (its shape
                                                   depends on the operands' strides) -> matmul(a, b)
Patterns are traced and canonicalized by the same code, so both sides meet in one form.
"""
import operator

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.traceback import preserve_node_meta

from . import _compat

aten = torch.ops.aten


class Unsupported(Exception):
    """The graph cannot be rewritten; the message is the reason recorded in the decision log."""


# --- Dynamo graph -> ATen graph ------------------------------------------------------------------------
class _GradModeAwareInterpreter(fx.Interpreter):
    """Runs the Dynamo graph under make_fx; values computed where the graph itself turned grad off
    (torch.no_grad inside the model) are detached in the traced graph, so the autograd that later
    runs on it sees exactly the eager graph's grad paths. Called with grad already off (inference),
    nothing needs a gradient and nothing is detached."""

    def run(self, *args, **kwargs):
        self.grad_on_entry = torch.is_grad_enabled()
        return super().run(*args, **kwargs)

    def run_node(self, n):
        result = super().run_node(n)
        if self.grad_on_entry and not torch.is_grad_enabled():
            result = _detach(result)
        return result

    def call_function(self, target, args, kwargs):
        if target is torch.einsum and not kwargs:
            product = einsum_as_matmul(*args)
            if product is not None:
                return product
        return super().call_function(target, args, kwargs)


def einsum_as_matmul(equation, *operands):
    """A two-operand einsum that is a (broadcast) batched matrix product, as permute -> matmul ->
    permute: the spelling that canonicalizes like `a @ b`. One index is contracted; an output index
    that only one operand has is that operand's free (row or column) index, and when an operand has two
    such, its leading one is a batch index the other operand is broadcast along ("td,edf->tef": every
    expert's product of x); an operand without a free index gets a unit one ("ted,te->td": the gates'
    weighted sum). None for any other einsum."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not isinstance(equation, str) or len(operands) != 2 or "->" not in equation or "." in equation:
        return None
    lhs, out = equation.replace(" ", "").split("->")
    terms = lhs.split(",")
    if len(terms) != 2:
        return None
    a_idx, b_idx = terms
    a, b = operands
    if len(set(a_idx)) != len(a_idx) or len(set(b_idx)) != len(b_idx) or len(set(out)) != len(out) or \
            a.dim() != len(a_idx) or b.dim() != len(b_idx) or any(c not in a_idx + b_idx for c in out):
        return None
    contracted = [c for c in a_idx if c in b_idx and c not in out]
    batch = [c for c in out if c in a_idx and c in b_idx]
    free_a = [c for c in a_idx if c not in b_idx]
    free_b = [c for c in b_idx if c not in a_idx]
    if len(contracted) != 1 or any(c not in out for c in free_a + free_b) or len(free_a) + len(free_b) > 3:
        return None
    if len(free_a) == 2:
        batch.append(free_a.pop(0))
    elif len(free_b) == 2:
        batch.append(free_b.pop(0))
    if len(free_a) > 1 or len(free_b) > 1:
        return None
    a_p = _broadcast_operand(a, a_idx, batch, free_a + contracted)
    b_p = _broadcast_operand(b, b_idx, batch, contracted + free_b)
    if not free_a:
        a_p = a_p.unsqueeze(-2)
    if not free_b:
        b_p = b_p.unsqueeze(-1)
    batch_shape = torch.broadcast_shapes(a_p.shape[:-2], b_p.shape[:-2])
    a_p, b_p = (t if t.shape[:-2] == batch_shape else t.expand(*batch_shape, *t.shape[-2:]) for t in (a_p, b_p))
    product = torch.matmul(a_p, b_p)
    if not free_b:
        product = product.squeeze(-1)
    if not free_a:
        product = product.squeeze(-2 if free_b else -1)
    product_idx = batch + free_a + free_b
    return _permuted(product, [product_idx.index(c) for c in out])


def _broadcast_operand(t, idx, batch, rest):
    """t permuted to batch + rest, with a unit dim where it lacks a batch index (expanded by the caller)."""
    t = _permuted(t, [idx.index(c) for c in batch if c in idx] + [idx.index(c) for c in rest])
    for position, c in enumerate(batch):
        if c not in idx:
            t = t.unsqueeze(position)
    return t


def _permuted(t, dims):
    return t if dims == list(range(t.dim())) else t.permute(dims)


def _detach(value):
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(_detach(v) for v in value)
    return value


def _is_dynamic(t) -> bool:
    if isinstance(t, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    if isinstance(t, torch.Tensor):
        return any(isinstance(s, torch.SymInt) for s in (*t.shape, *t.stride()))
    return False


_PLAIN = (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer)


def check_traceable(gm: fx.GraphModule, example_inputs) -> None:
    """Raise Unsupported for graphs we do not re-trace (the reason goes to the decision log)."""
    if any(_is_dynamic(t) for t in example_inputs):
        raise Unsupported("dynamic shapes: the graph has symbolic sizes (mark_static or dynamic=False to fuse)")
    subclasses = sorted({type(t).__name__ for t in example_inputs if isinstance(t, torch.Tensor)
                         and not isinstance(t, _compat.FakeTensor) and type(t) not in _PLAIN})
    if subclasses:
        raise Unsupported(f"tensor subclass inputs ({', '.join(subclasses)}): the graph is handed off as it is")
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, _compat.HigherOrderOperator):
            raise Unsupported(f"higher-order op {node.target.name()} in the graph")
        if node.op == "get_attr":
            value = getattr(gm, node.target, None)
            if isinstance(value, torch.Tensor) and value.requires_grad:
                raise Unsupported(f"parameter {node.target} is a graph attribute, not an input "
                                  "(torch._dynamo.config.inline_inbuilt_nn_modules=False is not supported)")


def to_aten(gm: fx.GraphModule, example_inputs) -> tuple[fx.GraphModule, list]:
    """Re-trace a Dynamo graph into a canonical ATen graph on fake tensors; returns (graph, fakes)."""
    check_traceable(gm, example_inputs)
    fake_mode = _compat.detect_fake_mode(example_inputs) or _compat.FakeTensorMode()
    fakes = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
    grad_enabled = torch.is_grad_enabled()
    try:
        with fake_mode, preserve_node_meta():
            traced = make_fx(_GradModeAwareInterpreter(gm).run,
                             decomposition_table=_compat.CANONICAL_DECOMPOSITIONS)(*fakes)
    except Exception as e:  # any failure to re-trace leaves the graph to the hand-off, with the reason
        raise Unsupported(f"re-tracing to ATen failed: {type(e).__name__}: {e}") from e
    finally:
        torch.set_grad_enabled(grad_enabled)
    canonicalize(traced.graph)
    traced.recompile()
    return traced, fakes


def trace_function(fn, example_inputs) -> fx.GraphModule:
    """Trace a plain PyTorch function (a pattern's search or replacement) into canonical ATen."""
    with _compat.FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fakes = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
        traced = make_fx(fn, decomposition_table=_compat.CANONICAL_DECOMPOSITIONS)(*fakes)
    canonicalize(traced.graph)
    traced.recompile()
    return traced


# --- canonicalization passes -------------------------------------------------------------------------
def val(node):
    """The fake value a node carries (make_fx records it as meta['val'])."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def is_float_cast(node) -> bool:
    """A _to_copy that only changes a floating dtype (no device, layout or memory-format change)."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is aten._to_copy.default):
        return False
    src, out = val(node.args[0]), val(node)
    if src is None or out is None or src.device != out.device:
        return False
    extra = {k: v for k, v in node.kwargs.items() if v is not None and k not in ("dtype", "layout", "device")}
    return src.dtype in _FLOATS and out.dtype in _FLOATS and not extra.get("memory_format") and \
        not extra.get("non_blocking") and not extra.get("pin_memory")


_SCALAR_POINTWISE = (aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.tanh.default,
                     aten.neg.default)


def _elementwise_on_one(node) -> bool:
    """A float cast, or a pointwise op whose only tensor argument is its first (x / c, tanh(x), ...)."""
    if is_float_cast(node):
        return True
    return (isinstance(node, fx.Node) and node.op == "call_function" and node.target in _SCALAR_POINTWISE
            and not any(isinstance(a, fx.Node) for a in (*node.args[1:], *node.kwargs.values())))


def _view_first(graph: fx.Graph, node: fx.Node) -> fx.Node | None:
    """view(f(x)) -> f(view(x)) for a cast or a scalar pointwise f (HF's LM loss: the upcast and the
    soft-cap move next to the loss, so a region binds the viewed logits in their own dtype, no copy
    is materialized, and the views meet the matmul's). Returns the new view, or None."""
    if node.target not in _VIEWS or not _elementwise_on_one(node.args[0]) or len(node.args[0].users) != 1:
        return None
    op, src = node.args[0], node.args[0].args[0]
    mode = getattr(val(src), "fake_mode", None)
    if mode is None:
        return None
    with mode:
        viewed = val(src).view(node.args[1])
    with graph.inserting_before(node):
        view = graph.call_function(node.target, (src, *node.args[1:]), dict(node.kwargs))
        new_op = graph.call_function(op.target, (view, *op.args[1:]), dict(op.kwargs))
    view.meta = dict(node.meta, val=viewed)
    new_op.meta = dict(node.meta)
    node.replace_all_uses_with(new_op)
    graph.erase_node(node)
    graph.erase_node(op)  # its only user was node: the next op up may now have a single user
    return view


def _fill_defaults(node: fx.Node) -> None:
    schema = node.target._schema
    args = list(node.args)
    kwargs = dict(node.kwargs)
    for i, arg in enumerate(schema.arguments):
        if arg.kwarg_only:
            if arg.name not in kwargs and arg.has_default_value():
                kwargs[arg.name] = arg.default_value
        elif i >= len(args):
            if arg.name in kwargs:
                args.append(kwargs.pop(arg.name))
            elif arg.has_default_value():
                args.append(arg.default_value)
    if kwargs.get("pin_memory") is None and "pin_memory" in kwargs:
        kwargs["pin_memory"] = False  # None and False both mean "not pinned"
    node.args, node.kwargs = tuple(args), kwargs


_SCALAR_TO_TENSOR = {
    aten.add.Scalar: aten.add.Tensor, aten.sub.Scalar: aten.sub.Tensor,
    aten.mul.Scalar: aten.mul.Tensor, aten.div.Scalar: aten.div.Tensor,
}

# op -> (position of the dim argument, rank offset: the dim indexes the output for unsqueeze)
_DIM_ARG = {
    aten.mean.dim: (1, 0), aten.sum.dim_IntList: (1, 0), aten.amax.default: (1, 0),
    aten.amin.default: (1, 0), aten.slice.Tensor: (1, 0), aten.split.Tensor: (2, 0),
    aten.split_with_sizes.default: (2, 0), aten._softmax.default: (1, 0),
    aten._log_softmax.default: (1, 0), aten.select.int: (1, 0), aten.unsqueeze.default: (1, 1),
    aten.squeeze.dim: (1, 0), aten.transpose.int: (1, 0), aten.var.correction: (1, 0),
    aten.flatten.using_ints: (1, 0),
}


def _functional_overload(target):
    """aten.add_.Scalar -> aten.add.Scalar (None when there is no such functional overload)."""
    name = target._schema.name.split("::")[-1]
    if not name.endswith("_") or name.startswith("_"):
        return None
    packet = getattr(aten, name[:-1], None)
    return getattr(packet, target._overloadname, None) if packet is not None else None


def _shared(node: fx.Node) -> bool:
    """Could a write into the node's output be seen through another value? Views and detach alias
    their input (F.embedding's max_norm renorms the table through a detach); an in-place op's
    output is its first argument, shared if that has other users or is itself shared; other ops
    (and getitem of their tuples) write fresh memory."""
    if node.op != "call_function":
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return node.target is not operator.getitem
    alias = next((r.alias_info for r in schema.returns if r.alias_info is not None), None)
    if alias is None:
        return False
    base = node.args[0]
    return not alias.is_write or not isinstance(base, fx.Node) or len(base.users) > 1 or _shared(base)


def _negative_dims(node: fx.Node) -> None:
    pos, extra = _DIM_ARG[node.target]
    src = node.args[0]
    if node.target is aten.transpose.int:
        positions = (1, 2)
    else:
        positions = (pos,)
    rank = val(src).dim() + extra if val(src) is not None else None
    if rank is None or rank == 0:
        return
    args = list(node.args)
    for p in positions:
        if p >= len(args):
            continue
        d = args[p]
        if isinstance(d, int):
            args[p] = d - rank if d >= 0 else d
        elif isinstance(d, (list, tuple)) and all(isinstance(i, int) for i in d):
            args[p] = [i - rank if i >= 0 else i for i in d]
    if node.target is aten.transpose.int and args[1] > args[2]:  # transpose(x, a, b) == transpose(x, b, a)
        args[1], args[2] = args[2], args[1]
    if node.target is aten.slice.Tensor and len(args) >= 4:
        size = val(src).shape[args[1]]
        args[2] = min(max(args[2] + size if args[2] < 0 else args[2], 0), size) if args[2] is not None else 0
        args[3] = min(max(args[3] + size if args[3] < 0 else args[3], 0), size) if args[3] is not None else size
    node.args = tuple(args)


def _cat_dims(node: fx.Node) -> None:
    tensors, dim = node.args[0], node.args[1]
    first = val(tensors[0]) if tensors else None
    if first is not None and isinstance(dim, int) and dim >= 0:
        node.args = (tensors, dim - first.dim())


def _single_swap(node: fx.Node) -> None:
    """permute that exchanges exactly two dims -> transpose (the spelling patterns use)."""
    dims = list(node.args[1])
    moved = [i for i, d in enumerate(dims) if d != i]
    if len(moved) == 2:
        rank = len(dims)
        node.target, node.args = aten.transpose.int, (node.args[0], moved[0] - rank, moved[1] - rank)


def _is_call(node, target) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is target


def _algebra(graph: fx.Graph, node: fx.Node) -> None:
    t, a = node.target, node.args
    if t in (aten.mul.Tensor, aten.div.Tensor) and len(a) >= 2 and isinstance(a[0], fx.Node) and \
            not isinstance(a[1], (fx.Node, bool)) and a[1] == 1 and val(a[0]) is not None and \
            val(node) is not None and val(a[0]).dtype == val(node).dtype:
        node.replace_all_uses_with(a[0])  # x * 1 (what Python's 1 / t leaves behind)
    elif t is aten.mul.Tensor and len(a) >= 2 and a[0] is a[1] and isinstance(a[0], fx.Node):
        node.target, node.args = aten.pow.Tensor_Scalar, (a[0], 2)
    elif t is aten.mul.Tensor and len(a) >= 2:
        for x, s in ((a[0], a[1]), (a[1], a[0])):
            if _is_call(s, aten.sigmoid.default) and s.args[0] is x:
                node.target, node.args = aten.silu.default, (x,)
                return
    elif t is aten.reciprocal.default and _is_call(a[0], aten.sqrt.default):
        node.target, node.args = aten.rsqrt.default, (a[0].args[0],)
    elif t is aten.div.Tensor and _is_call(a[1], aten.sqrt.default) and isinstance(a[0], fx.Node):
        with graph.inserting_before(node):
            r = graph.call_function(aten.rsqrt.default, (a[1].args[0],))
        r.meta = dict(a[1].meta)
        node.target, node.args = aten.mul.Tensor, (a[0], r)


_VIEWS = (aten.view.default, aten._unsafe_view.default)


def _matmul_operand(node):
    """The tensor a bmm operand was flattened from: view(clone?(expand?(t))) -> t (None if not)."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target in _VIEWS):
        return None
    src = node.args[0]
    if _is_call(src, aten.clone.default):
        src = src.args[0]
    if _is_call(src, aten.expand.default):
        src = src.args[0]
    return src if isinstance(src, fx.Node) and val(src) is not None and val(src).dim() >= 3 else None


def _recompose_matmul(graph: fx.Graph, node: fx.Node) -> None:
    """view(bmm(flatten(a), flatten(b)), out_shape) -> matmul(a, b) when the shapes agree; a plain
    bmm(a, b) (torch.bmm, or @ on 3-D tensors) is the same product: matmul(a, b) too."""
    if node.target is aten.bmm.default and not all(_matmul_operand(x) is not None for x in node.args[:2]):
        a, b = node.args[0], node.args[1]
    elif node.target in _VIEWS and _is_call(node.args[0], aten.bmm.default) and len(node.args[0].users) == 1:
        bmm = node.args[0]
        a, b = _matmul_operand(bmm.args[0]), _matmul_operand(bmm.args[1])
        if a is None or b is None:
            return
    else:
        return
    if val(a) is None or val(b) is None:
        return
    va, vb, out = val(a), val(b), val(node)
    if out is None or va.shape[-1] != vb.shape[-2]:
        return
    try:
        batch = torch.broadcast_shapes(va.shape[:-2], vb.shape[:-2])
    except RuntimeError:
        return
    if tuple(out.shape) != (*batch, va.shape[-2], vb.shape[-1]):
        return
    mode = getattr(va, "fake_mode", None)
    if mode is None:
        return
    with mode:
        recomposed = torch.matmul(va, vb)
    if recomposed.stride() != out.stride():  # later views may rely on the original layout
        return
    with graph.inserting_before(node):
        mm = graph.call_function(aten.matmul.default, (a, b))
    mm.meta = dict(node.meta)
    node.replace_all_uses_with(mm)


def _collapse_view(graph: fx.Graph, node: fx.Node) -> None:
    """view(view(x, s1), s2) -> view(x, s2); a view to x's own shape and strides -> x (what F.linear on
    3-D input leaves between the LM head's matmul and the flattened logits of the loss)."""
    if node.target not in _VIEWS or not (isinstance(node.args[0], fx.Node) and node.args[0].target in _VIEWS):
        return
    src, out = node.args[0].args[0], val(node)
    v = val(src)
    if v is None or out is None or not isinstance(src, fx.Node):
        return
    if tuple(v.shape) == tuple(out.shape) and v.stride() == out.stride():
        node.replace_all_uses_with(src)
        return
    mode = getattr(v, "fake_mode", None)
    if mode is None:
        return
    try:
        with mode:
            viewed = v.view(out.shape)
    except RuntimeError:
        return
    if viewed.stride() == out.stride():
        node.args = (src, *node.args[1:])


def _where_as_masked_fill(graph: fx.Graph, node: fx.Node) -> None:
    """where(keep, x, c) -> x.masked_fill(~keep, c) and where(masked, c, x) -> x.masked_fill(masked, c)
    for a constant c (torch.where spells a mask with a scalar as a 0-d scalar_tensor)."""
    if node.target is not aten.where.self:
        return
    cond, a, b = node.args
    for x, c, negate in ((a, b, True), (b, a, False)):
        if _is_call(c, aten.scalar_tensor.default) and isinstance(x, fx.Node) and val(x) is not None \
                and val(node) is not None and val(x).dtype == val(node).dtype and val(x).shape == val(node).shape:
            masked = cond
            with graph.inserting_before(node):
                if negate:
                    masked = graph.call_function(aten.bitwise_not.default, (cond,))
                    masked.meta = dict(cond.meta, val=~val(cond)) if val(cond) is not None else dict(cond.meta)
                fill = graph.call_function(aten.masked_fill.Scalar, (x, masked, c.args[0]))
            fill.meta = dict(node.meta)
            node.replace_all_uses_with(fill)
            return


def _scale_after_matmul(graph: fx.Graph, node: fx.Node) -> None:
    """matmul(x * c, y) -> matmul(x, y) * c for a Python scalar c (attention with q pre-scaled meets
    the scores-scaled spelling; the product differs only by where one rounding happens)."""
    if node.target is not aten.matmul.default:
        return
    x, y = node.args[:2]
    if not (_is_call(x, aten.mul.Tensor) and len(x.users) == 1 and isinstance(x.args[1], (int, float))
            and not isinstance(x.args[1], bool) and isinstance(x.args[0], fx.Node)):
        return
    with graph.inserting_before(node):
        mm = graph.call_function(aten.matmul.default, (x.args[0], y))
        scaled = graph.call_function(aten.mul.Tensor, (mm, x.args[1]))
    mm.meta, scaled.meta = dict(node.meta), dict(node.meta)
    node.replace_all_uses_with(scaled)


def canonicalize(graph: fx.Graph) -> None:
    for node in list(graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, _compat.OpOverload):
            continue
        functional = _functional_overload(node.target)
        src = node.args[0] if node.args else None
        if (functional is not None and isinstance(src, fx.Node) and src.op == "call_function"
                and len(src.users) == 1 and not _shared(src)):
            node.target = functional
        node.target = _SCALAR_TO_TENSOR.get(node.target, node.target)
        if node.target is aten.permute.default:
            _single_swap(node)
        _fill_defaults(node)
        if node.target in _DIM_ARG:
            _negative_dims(node)
        elif node.target is aten.cat.default:
            _cat_dims(node)
        _algebra(graph, node)
        _where_as_masked_fill(graph, node)
    graph.eliminate_dead_code()  # make_fx's unused detach nodes would count as users below
    for node in list(graph.nodes):
        if node.op == "call_function":
            _recompose_matmul(graph, node)
            view = node
            while view is not None:
                view = _view_first(graph, view)
    graph.eliminate_dead_code()  # the operands' old users (expand/view for bmm) would count below
    for node in list(graph.nodes):
        if node.op == "call_function":
            _collapse_view(graph, node)
            _scale_after_matmul(graph, node)
    graph.eliminate_dead_code()

