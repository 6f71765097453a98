"""Graphs that update state in place (optimizer steps): per-tensor lanes, one multi-tensor launch each.

Dynamo hands over `opt.step` (or a train step's update part) with the parameters and optimizer state
as graph attributes, and the update as in-place ops: `torch._foreach_*` calls (foreach spelling) or
one chain per parameter (for-loop spelling). Here:
  1. lift     tensor attributes become graph inputs (detached aliases: the update writes the
              parameters' storage, outside autograd, as the optimizer does under no_grad)
  2. unroll   each torch._foreach_* call becomes one call per tensor (its exact per-tensor meaning);
              Tensor.item() of a 0-dim tensor (an lr scheduled as a float) stays a 0-dim tensor
  3. trace    to ATen on fake tensors (no canonicalization: the update is compiled as written)
  4. lanes    the graph is read as values: each in-place op gives its target a new value. A lane is
              the set of same-shaped tensor values connected through elementwise ops, ending in the
              values written back to inputs; 0-dim values (step counts, bias corrections, a clip
              coefficient) and reductions (a gradient norm) stay in the graph, and reach the lanes as
              per-lane scalars
  5. rewrite  lanes with one program (the same ops, constants and dtypes) become one call of
              fusion::multi_tensor_apply; the rest of the graph is handed off as usual.
"""
import dataclasses
import itertools
import operator

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from . import _compat
from .canonical import Unsupported
from fusion_compiler.codegen.multi_tensor import DTYPES, OPS, Program

aten = torch.ops.aten


# --- 1. lift -----------------------------------------------------------------------------------------
def has_tensor_attributes(gm: fx.GraphModule) -> bool:
    return any(n.op == "get_attr" and isinstance(getattr(gm, n.target, None), torch.Tensor) for n in gm.graph.nodes)


def is_update(gm: fx.GraphModule) -> bool:
    """Is the graph an in-place update outside autograd (an optimizer step, a gradient clip): does it
    write its inputs or the tensors it holds as attributes (Dynamo's view of an optimizer's state)
    with grad disabled (on entry, or by its first op, as torch.optim's step and no_grad blocks do)?"""
    nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    grad_off = not torch.is_grad_enabled() or (
        bool(nodes) and nodes[0].target is _compat.set_grad_enabled and nodes[0].args == (False,))
    if not grad_off:
        return False
    tensors = {n for n in gm.graph.nodes if n.op == "placeholder"} | \
              {n for n in gm.graph.nodes if n.op == "get_attr" and isinstance(getattr(gm, n.target, None), torch.Tensor)}
    for n in nodes:
        name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
        first = n.args[0] if n.args else None
        targets = first if isinstance(first, (list, tuple)) else [first]
        inplace = isinstance(name, str) and name.endswith("_") and not name.startswith("__")
        if (inplace or n.target in _IADD) and any(t in tensors for t in targets):
            return True
    return False


_IADD = {operator.iadd, operator.isub, operator.imul, operator.itruediv}


def lift(gm: fx.GraphModule) -> tuple[fx.GraphModule, list, list]:
    """A copy of gm whose tensor attributes are trailing inputs; returns (graph, their detached
    values, the attributes themselves)."""
    graph = fx.Graph()
    env, lifted, values = {}, [], []
    attrs = [n for n in gm.graph.nodes if n.op == "get_attr" and isinstance(getattr(gm, n.target), torch.Tensor)]
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = graph.node_copy(n, env.__getitem__)
    for n in attrs:
        env[n] = graph.placeholder(n.name)
        env[n].meta = dict(n.meta)
        values.append(getattr(gm, n.target).detach())
        lifted.append(n)
    for n in gm.graph.nodes:
        if n.op != "placeholder" and n not in env:
            env[n] = graph.node_copy(n, env.__getitem__)
    return fx.GraphModule(gm, graph), values, [getattr(gm, n.target) for n in lifted]


def gradient_inputs(tensors: list) -> set:
    """Positions of the tensors that are another one's .grad (an optimizer's reads, or a clip's writes)."""
    grads = {id(t.grad) for t in tensors if isinstance(t, torch.Tensor) and t.grad is not None}
    return {i for i, t in enumerate(tensors) if id(t) in grads}


# --- 2. unroll, 3. trace -----------------------------------------------------------------------------
def _foreach_name(target) -> str | None:
    name = getattr(target, "__name__", "")
    name = name.split(".")[0]
    return name if name.startswith("_foreach_") else None


def uses_foreach(gm: fx.GraphModule) -> bool:
    """Is the update spelled with torch._foreach_* ops (Inductor groups those into fewer kernels)?"""
    return any(n.op == "call_function" and _foreach_name(n.target) for n in gm.graph.nodes)


def _lane_args(values, i: int, n: int):
    return [v[i] if isinstance(v, (list, tuple)) and len(v) == n else v for v in values]


def unrolled(name: str, args, kwargs):
    """torch._foreach_<op>[_](lists...) as one call per list element."""
    op = name[len("_foreach_"):]
    inplace = op.endswith("_")
    op = op.rstrip("_")
    n = next(len(a) for a in args if isinstance(a, (list, tuple)))
    args = list(args)
    kwargs = dict(kwargs)
    if op in ("addcmul", "addcdiv"):  # scalars: a list, or a 1-D tensor with one value per tensor
        scalars = kwargs.pop("scalars", kwargs.pop("value", args.pop(3) if len(args) > 3 else 1))
        if isinstance(scalars, torch.Tensor) and scalars.dim() == 1:
            scalars = list(scalars.unbind(0))
        kwargs["value"] = scalars
    results = []
    for i in range(n):
        a = _lane_args(args, i, n)
        kw = dict(zip(kwargs, _lane_args(list(kwargs.values()), i, n)))
        results.append(_one(op, inplace, a, kw))
    return None if inplace else results


def _one(op: str, inplace: bool, args, kwargs):
    if op == "norm":
        return torch.linalg.vector_norm(args[0], args[1] if len(args) > 1 else 2, dtype=kwargs.get("dtype"))
    if op in ("addcmul", "addcdiv") and isinstance(kwargs.get("value"), torch.Tensor):
        value = kwargs.pop("value")
        term = (torch.mul if op == "addcmul" else torch.div)(args[1], args[2]) * value
        return args[0].add_(term) if inplace else torch.add(args[0], term)
    if not inplace:
        return getattr(torch, op)(*args, **kwargs)
    method = getattr(torch.Tensor, op + "_", None)
    if method is not None:
        return method(*args, **kwargs)
    return args[0].copy_(getattr(torch, op)(*args, **kwargs))


class _Unroll(fx.Interpreter):
    def call_function(self, target, args, kwargs):
        name = _foreach_name(target)
        if name is not None:
            return unrolled(name, args, kwargs)
        return super().call_function(target, args, kwargs)

    def call_method(self, target, args, kwargs):
        if target == "item" and isinstance(args[0], torch.Tensor) and args[0].dim() == 0:
            return args[0]  # keep a scheduled float hyper-parameter a tensor (no data-dependent trace)
        return super().call_method(target, args, kwargs)


def trace(gm: fx.GraphModule, example_inputs) -> fx.GraphModule:
    """The lifted Dynamo graph as ATen ops (foreach calls unrolled), traced on fake tensors."""
    fake_mode = _compat.FakeTensorMode()
    fakes = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
    try:
        with fake_mode, torch.no_grad():
            return make_fx(_Unroll(gm).run)(*fakes)
    except Exception as e:
        raise Unsupported(f"re-tracing the update to ATen failed: {type(e).__name__}: {e}") from e


# --- 4. lanes ----------------------------------------------------------------------------------------
_ALIASES = {aten.alias.default, aten.detach.default, aten.lift_fresh.default}


@dataclasses.dataclass(eq=False)
class Value:
    """A value of the traced update: an input's initial value ("input"), or an ATen op of values."""
    op: str
    args: tuple
    kwargs: dict
    node: fx.Node
    order: int

    @property
    def shape(self) -> tuple:
        value = self.node.meta.get("val")
        return tuple(value.shape) if isinstance(value, torch.Tensor) else ()

    @property
    def dtype(self):
        value = self.node.meta.get("val")
        return value.dtype if isinstance(value, torch.Tensor) else None

    @property
    def is_tensor(self) -> bool:  # a lane value (0-dim values are per-lane scalars)
        return len(self.shape) > 0


@dataclasses.dataclass
class Values:
    """The graph read as values: final value of each input, the value each node had, and for each
    node the storage it aliases (an in-place op's result is its target)."""
    final: dict
    last: dict  # storage -> its value at the end of the graph
    at: dict
    root: dict
    reads: dict  # kept node -> the values its arguments had when it ran
    opaque_writes: list  # ops that write their arguments in a way not followed here (lists of tensors)


def values_of(gm: fx.GraphModule) -> Values:
    root, current, at, reads, opaque_writes = {}, {}, {}, {}, []
    counter = itertools.count()

    def read(a):
        if isinstance(a, fx.Node):
            return current[root[a]]
        if isinstance(a, (list, tuple)):
            return type(a)(read(x) for x in a)
        return a

    for n in gm.graph.nodes:
        if n.op == "placeholder":
            root[n] = n
            current[n] = Value("input", (), {}, n, next(counter))
        elif n.op == "call_function" and n.target in _ALIASES:
            root[n] = root[n.args[0]]
        elif n.op == "call_function" and isinstance(n.target, _compat.OpOverload) \
                and isinstance(n.meta.get("val"), torch.Tensor):
            args, kwargs = read(n.args), {k: read(v) for k, v in n.kwargs.items()}
            reads[n] = (args, kwargs)
            schema = n.target._schema
            mutates = bool(schema.arguments) and schema.arguments[0].alias_info is not None \
                and schema.arguments[0].alias_info.is_write
            name = schema.name.split("::")[1]
            if mutates:
                if name.endswith("_"):
                    name = name[:-1]
                root[n] = root[n.args[0]]
                if name == "copy":  # copy_(dst, src): the new value is src in dst's dtype
                    args = (args[1],)
                    name = "_to_copy"
                current[root[n]] = Value(name, args, kwargs, n, next(counter))
            else:
                root[n] = n
                current[n] = Value(name, args, kwargs, n, next(counter))
            at[n] = current[root[n]]
        elif n.op == "call_function":
            if isinstance(n.target, _compat.OpOverload) and any(
                    a.alias_info is not None and a.alias_info.is_write for a in n.target._schema.arguments):
                opaque_writes.append(str(n.target.overloadpacket))  # e.g. torch._fused_adamw_ on lists
            root[n] = n
            current[n] = Value("opaque", (), {}, n, next(counter))
            reads[n] = (read(n.args), {k: read(v) for k, v in n.kwargs.items()})
            at[n] = current[n]
        elif n.op == "output":
            reads[n] = (read(n.args), {})
    final = {n: current[n] for n in gm.graph.nodes if n.op == "placeholder"}
    return Values(final, current, at, root, reads, sorted(set(opaque_writes)))


@dataclasses.dataclass
class Lane:
    """One tensor's update: the inputs it reads and writes, its scalars, and its program."""
    writes: list  # placeholders written, in slot order
    reads: list  # placeholders only read (or written by the graph, but not stored: `unstored`)
    scalars: list  # 0-dim Values read
    values: list  # its tensor Values, in graph order
    program: Program | None = None
    reason: str = ""  # why it cannot be fused ("" when it can)
    unstored: list = dataclasses.field(default_factory=list)  # written by the graph, not by the kernel


def _tensor_values(v, out: set, scalars: list) -> None:
    """Collect the lane reachable from v: its tensor Values (inputs too) and the scalars they read."""
    stack = [v]
    while stack:
        v = stack.pop()
        if not isinstance(v, Value):
            if isinstance(v, (list, tuple)):
                stack.extend(v)
            continue
        if not v.is_tensor:
            if v not in scalars:
                scalars.append(v)
            continue
        if v in out:
            continue
        out.add(v)
        stack.extend(v.args)
        stack.extend(v.kwargs.values())


def lanes(vals: Values) -> list[Lane]:
    """The graph's lanes: connected sets of tensor values that end in written inputs. Slots are
    ordered by first use, so lanes written alike (foreach or for-loop) get one program."""
    groups: list[tuple[set, list, list]] = []  # (values, written placeholders, scalars)
    for ph, v in vals.final.items():
        if v.op == "input" or not v.is_tensor:
            continue
        members, scalars = set(), []
        _tensor_values(v, members, scalars)
        joined = [g for g in groups if g[0] & members]
        outs = [ph]
        for g in joined:
            groups.remove(g)
            members |= g[0]
            outs += g[1]
            scalars += [s for s in g[2] if s not in scalars]
        groups.append((members, outs, scalars))
    result = []
    for members, outs, scalars in groups:
        ordered = sorted(members, key=lambda v: v.order)
        computed = [v for v in ordered if v.op != "input"]
        first_use = {}
        for v in computed:
            for a in flat_args((v.args, tuple(v.kwargs.values()))):
                if isinstance(a, Value) and a.op == "input" and a.node not in first_use:
                    first_use[a.node] = v.order
        for ph in outs:
            first_use.setdefault(ph, vals.final[ph].order)
        reads = sorted((v.node for v in ordered if v.op == "input" and v.node not in outs), key=first_use.get)
        result.append(Lane(sorted(outs, key=first_use.get), reads, sorted(scalars, key=lambda v: v.order), computed))
    return result


def flat_args(items):
    """The leaves of nested argument lists and tuples."""
    for a in items:
        if isinstance(a, (list, tuple)):
            yield from flat_args(a)
        else:
            yield a


# ATen op -> (program op, how its arguments map); identities first
_IDENTITY = {"clone", "alias", "detach", "contiguous"}
_SIMPLE = {"neg", "abs", "sqrt", "rsqrt", "reciprocal", "exp", "log", "sigmoid", "tanh", "sign", "sgn",
           "maximum", "minimum", "where", "gt", "lt", "ge", "le", "eq", "ne"}
_FLOATS = {dtype: name for name, dtype in DTYPES.items() if dtype.is_floating_point}  # torch dtype -> slot dtype


class NotFusable(Exception):
    pass


def program_of(lane: Lane, vals: Values) -> Program:
    """The lane as a Program (raises NotFusable with the reason)."""
    refs: dict = {}
    slot_of_input = {ph: ("r", j) for j, ph in enumerate(lane.reads)}
    slot_of_input.update({ph: ("w", j) for j, ph in enumerate(lane.writes)})
    for j, s in enumerate(lane.scalars):
        refs[s] = ("s", j)
    shape = None
    steps: list = []

    def ref(a):
        if isinstance(a, Value):
            if a.op == "input":
                return slot_of_input[a.node]
            return refs[a]
        if isinstance(a, bool) or not isinstance(a, (int, float)):
            raise NotFusable(f"argument {a!r} is not a number or a lane value")
        if a != a or a in (float("inf"), float("-inf")):
            raise NotFusable(f"non-finite constant {a}")
        return ("c", float(a))

    def step(op, args, dtype):
        steps.append((op, tuple(args), dtype))
        return ("v", len(steps) - 1)

    for v in lane.values:
        if shape is None:
            shape = v.shape
        if v.shape != shape:
            raise NotFusable(f"tensors of shapes {list(shape)} and {list(v.shape)} in one update")
        dtype = _FLOATS.get(v.dtype, "bool" if v.dtype == torch.bool else None)
        if dtype is None:
            raise NotFusable(f"dtype {v.dtype} (float32, bfloat16, float16 are fused)")
        for a in itertools.chain(v.args, v.kwargs.values()):
            if isinstance(a, Value) and a.is_tensor and a.shape != shape:
                raise NotFusable(f"broadcast of {list(a.shape)} to {list(shape)}")
        refs[v] = _translate(v, ref, step, dtype)
    for ph in lane.reads + lane.writes:
        val = ph.meta["val"]
        if tuple(val.shape) != shape:
            raise NotFusable(f"tensors of shapes {list(shape)} and {list(val.shape)} in one update")
        if val.dtype not in _FLOATS:
            raise NotFusable(f"dtype {val.dtype} (float32, bfloat16, float16 are fused)")
    stores = tuple((j, refs[vals.final[ph]]) for j, ph in enumerate(lane.writes))
    return Program(tuple(_FLOATS[ph.meta["val"].dtype] for ph in lane.reads),
                   tuple(_FLOATS[ph.meta["val"].dtype] for ph in lane.writes),
                   len(lane.scalars), tuple(steps), stores)


def _translate(v: Value, ref, step, dtype: str):
    """One ATen op of a lane as program steps; returns the reference of its result."""
    op, a, kw = v.op, v.args, dict(v.kwargs)
    alpha = kw.pop("alpha", 1)
    if op in _IDENTITY and not kw:
        return ref(a[0])
    if op in ("_to_copy", "to") and set(kw) <= {"dtype", "layout", "device", "memory_format"}:
        return step("cast", [ref(a[0])], dtype)
    if op in ("zeros_like", "ones_like", "full_like", "zero", "fill"):
        value = {"zeros_like": 0.0, "zero": 0.0, "ones_like": 1.0}.get(op, a[1] if len(a) > 1 else None)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise NotFusable(f"aten.{op} with a non-constant value")
        return ref(torch.tensor(value, dtype=v.dtype).item())  # the constant as the tensor holds it
    if kw and op not in ("add", "sub", "rsub", "addcmul", "addcdiv", "clamp", "clamp_min", "clamp_max", "lerp"):
        raise NotFusable(f"aten.{op} with {sorted(kw)}")
    if op in ("add", "sub", "rsub"):
        x, y = (a[1], a[0]) if op == "rsub" else (a[0], a[1])
        y = ref(y) if alpha == 1 else step("mul", [ref(y), ref(alpha)], "float32")
        return step("sub" if op in ("sub", "rsub") else "add", [ref(x), y], dtype)
    if op in ("mul", "div") and len(a) == 2 and not kw:
        return step(op, [ref(a[0]), ref(a[1])], dtype)
    if op in ("addcmul", "addcdiv"):
        value = kw.pop("value", a[3] if len(a) > 3 else 1)
        term = step("mul" if op == "addcmul" else "div", [ref(a[1]), ref(a[2])], "float32")
        if value != 1:
            term = step("mul", [ref(value), term], "float32")
        return step("add", [ref(a[0]), term], dtype)
    if op == "lerp":
        return step("lerp", [ref(a[0]), ref(a[1]), ref(a[2])], dtype)
    if op == "fma":
        return step("fma", [ref(a[0]), ref(a[1]), ref(a[2])], dtype)
    if op == "pow" and len(a) == 2 and isinstance(a[1], (int, float)) and a[1] in (0.5, 1, 2, 3):
        x = ref(a[0])
        if a[1] == 0.5:
            return step("sqrt", [x], dtype)
        r = x
        for _ in range(int(a[1]) - 1):
            r = step("mul", [r, x], "float32")
        return step("cast", [r], dtype)
    if op in ("clamp", "clamp_min", "clamp_max"):
        lo = kw.get("min", a[1] if len(a) > 1 and op != "clamp_max" else None)
        hi = kw.get("max", a[2] if len(a) > 2 else a[1] if op == "clamp_max" else None)
        r = ref(a[0])
        if lo is not None:
            r = step("maximum", [r, ref(lo)], "float32")
        if hi is not None:
            r = step("minimum", [r, ref(hi)], "float32")
        return step("cast", [r], dtype)
    if op in _SIMPLE:
        name = "sign" if op == "sgn" else op
        return step(name, [ref(x) for x in a], dtype)
    raise NotFusable(f"aten.{op} is not an elementwise op the update kernel knows")


assert {"add", "sub", "mul", "div", "lerp", "fma", "cast", "maximum", "minimum", "sqrt", "sign"} <= OPS


# --- 5. rewrite --------------------------------------------------------------------------------------
def residual_reason(vals: Values, fused: list[Lane]) -> str | None:
    """Why the fused lanes cannot run after the rest of the graph (None: they can). The rest must
    not read a lane's intermediate or updated values, and each scalar a lane reads must still hold
    its value at the end of the graph."""
    inside = {v for lane in fused for v in lane.values}
    for n, (args, kwargs) in vals.reads.items():
        if n in vals.at and vals.at[n] in inside:
            continue
        for a in flat_args((args, tuple(kwargs.values()))):
            if isinstance(a, Value) and a in inside:
                where = "the graph's output" if n.op == "output" else f"{n.target}"
                return f"{where} reads a value of the update before it ends ({a.node.target})"
    for lane in fused:
        for s in lane.scalars:
            if vals.last[vals.root[s.node]] is not s:
                return f"scalar {s.node.name} changes after the update reads it"
    return None


def rewrite(gm: fx.GraphModule, vals: Values, groups: list[list[Lane]]) -> None:
    """Each group of lanes (one program, one device) becomes one fusion::multi_tensor_apply call at
    the end of the graph; the ops of its lanes are erased."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    graph = gm.graph
    with graph.inserting_before(output):
        for group in groups:
            program = group[0].program
            device = group[0].writes[0].meta["val"].device
            rows = []
            for j in range(program.n_scalars):
                column = []
                for lane in group:
                    node = lane.scalars[j].node
                    value = node.meta["val"]
                    if value.dtype != torch.float32 or value.device != device:
                        node = graph.call_function(aten._to_copy.default, (node,),
                                                   {"dtype": torch.float32, "device": device})
                    column.append(node)
                rows.append(graph.call_function(aten.stack.default, (column,)))
            scalars = graph.call_function(aten.stack.default, (rows,)) if rows else \
                graph.call_function(aten.zeros.default, ([1, 1],), {"dtype": torch.float32, "device": device})
            reads = [ph for lane in group for ph in lane.reads]
            writes = [ph for lane in group for ph in lane.writes]
            graph.call_function(torch.ops.fusion.multi_tensor_apply.default, (program.text(), reads, writes, scalars))
    inside = {v for group in groups for lane in group for v in lane.values}
    erase = {n for n, v in vals.at.items() if v in inside}
    for n in reversed(list(graph.nodes)):
        if n in erase or (n.op == "call_function" and n.target in _ALIASES and not n.users):
            graph.erase_node(n)
    graph.lint()
    gm.recompile()
