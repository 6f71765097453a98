"""Structural matching of a pattern's canonical ATen graph against the user's canonical ATen graph.

Matching walks back from an anchor (the node that computes the pattern's first output):
- a pattern placeholder binds to any node (the same placeholder always to the same node);
- a pattern op matches a node with the same ATen overload, args unified recursively; add and mul
  are commutative;
- float-to-float casts (_to_copy with only a dtype change) are transparent on both sides, because
  every project kernel loads, computes in fp32 and writes the dtype of the region's output (a cast
  the user wrote after the region stays and applies to the op's output);
- x / d in the user's graph matches x * c in the pattern when c == 1 / d (scales are spelled both ways);
- literals: floats (ints) equal to a float (int) argument's example value bind that argument; ints that give
  sizes (view/expand/slice bounds/split sizes/normalized_shape) match any int in the loose pass,
  every other literal must be equal. A loose match is then verified exactly against the search
  function re-traced at the bound inputs' real shapes, dtypes and scalars (see Pattern.graph_at).
"""
import dataclasses
from typing import Optional

import torch
import torch.fx as fx

from .canonical import is_float_cast, val

aten = torch.ops.aten

_COMMUTATIVE = {aten.add.Tensor, aten.mul.Tensor}
# op -> positions of arguments that hold sizes (wildcards in the loose pass)
_SHAPE_ARGS = {
    aten.view.default: (1,), aten._unsafe_view.default: (1,), aten.reshape.default: (1,),
    aten.expand.default: (1,), aten.slice.Tensor: (2, 3), aten.split.Tensor: (1,),
    aten.split_with_sizes.default: (1,), aten.native_layer_norm.default: (1,),
    aten.narrow.default: (2, 3), aten.ones.default: (0,), aten.zeros.default: (0,), aten.full.default: (0,),
}


def strip_casts(node):
    while is_float_cast(node):
        node = node.args[0]
    return node


@dataclasses.dataclass
class Match:
    """A region of the user's graph that a pattern matched."""
    pattern: object
    anchor: fx.Node
    inputs: list  # per search-function argument: the bound fx.Node, or the scalar's value
    outputs: list  # user-graph nodes computing the pattern's outputs, in order
    nodes: list  # every user-graph node inside the region (outputs included), graph order

    def input_values(self) -> list:
        """Fake tensors (with real shapes, dtypes, strides, devices) and scalars of the inputs."""
        return [val(a) if isinstance(a, fx.Node) else a for a in self.inputs]

    def tensor_inputs(self) -> list:
        return [v for v in self.input_values() if isinstance(v, torch.Tensor)]

    def escaping(self, ignore=lambda user: False) -> Optional[tuple[fx.Node, fx.Node]]:
        """(intermediate, outside user) when an intermediate of the region is used outside it (users
        for which ignore(user) is true excepted). Intermediates that depend on no region input (a
        causal mask built from constants, shared by every layer) may have other users: they stay in
        the graph for them."""
        inside = set(self.nodes)
        outs = set(self.outputs)
        inputs = {a for a in self.inputs if isinstance(a, fx.Node)}
        dependent = set()
        for n in self.nodes:  # graph order: inputs of a node come before it
            if any(a in inputs or a in dependent for a in n.all_input_nodes):
                dependent.add(n)
        for n in self.nodes:
            if n in outs or n not in dependent:
                continue
            for user in n.users:
                if user not in inside and not ignore(user):
                    return n, user
        return None


class _State:
    __slots__ = ("bind", "scalars", "interior")

    def __init__(self, bind=None, scalars=None, interior=None):
        self.bind = dict(bind or {})
        self.scalars = dict(scalars or {})
        self.interior = list(interior or [])

    def copy(self):
        return _State(self.bind, self.scalars, self.interior)


class Matcher:
    """Matches one traced pattern graph; `exact` compares every literal."""

    def __init__(self, graph: fx.GraphModule, scalars: dict[int, float], exact: bool, read_casts: bool = True):
        """read_casts: a placeholder binds to the value before the user's float casts (kernels compute
        in fp32); False binds the cast value itself (when the search function needs its dtype)."""
        self.graph = graph
        self.exact = exact
        self.read_casts = read_casts
        self.placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
        self.sentinels = {(type(v), v): i for i, v in scalars.items()}
        out = next(n for n in graph.graph.nodes if n.op == "output")
        res = out.args[0]
        self.outputs = [strip_casts(o) for o in (res if isinstance(res, (list, tuple)) else [res])]
        self.anchor_target = self.outputs[0].target

    def match(self, pattern, anchor: fx.Node) -> Optional[Match]:
        st = _State()
        if not self._node(self.outputs[0], anchor, st):
            return None
        outs = [st.bind.get(p) for p in self.outputs]
        if any(o is None for o in outs):
            return None
        inputs = []
        for i, ph in enumerate(self.placeholders):
            if i in self.sentinels.values():
                if i not in st.scalars:
                    return None
                inputs.append(st.scalars[i])
            elif ph in st.bind:
                inputs.append(st.bind[ph])
            else:
                return None
        order = {n: i for i, n in enumerate(anchor.graph.nodes)} if len(st.interior) > 1 else {}
        nodes = sorted(set(st.interior), key=lambda n: order.get(n, 0))
        return Match(pattern, anchor, inputs, outs, nodes)

    # --- unification ---------------------------------------------------------------------------------
    def _node(self, p: fx.Node, t, st: _State) -> bool:
        if not isinstance(t, fx.Node):
            return False
        p = strip_casts(p)
        if p.op == "placeholder":
            t = strip_casts(t) if self.read_casts else t
            prev = st.bind.setdefault(p, t)
            return prev is t
        if p.op != "call_function":
            return False
        while is_float_cast(t):
            st.interior.append(t)
            t = t.args[0]
        if p in st.bind:
            return st.bind[p] is t
        if p.target is aten.mul.Tensor and _is_scalar_div(t):
            return self._scaled(p, t, st)
        if t.op != "call_function" or t.target != p.target or len(t.args) != len(p.args):
            return False
        if set(t.kwargs) != set(p.kwargs):
            return False
        shape_pos = _SHAPE_ARGS.get(p.target, ()) if not self.exact else ()
        orders = [(0, 1)]
        if p.target in _COMMUTATIVE and len(p.args) >= 2 and p.kwargs.get("alpha", 1) == 1:
            orders.append((1, 0))
        for order in orders:
            trial = st.copy()
            trial.bind[p] = t
            trial.interior.append(t)
            t_args = list(t.args)
            if order == (1, 0):
                t_args[0], t_args[1] = t_args[1], t_args[0]
            ok = all(self._arg(pa, ta, trial, i in shape_pos) for i, (pa, ta) in enumerate(zip(p.args, t_args)))
            ok = ok and all(self._arg(p.kwargs[k], t.kwargs[k], trial, False) for k in p.kwargs)
            if ok:
                st.bind, st.scalars, st.interior = trial.bind, trial.scalars, trial.interior
                return True
        return False

    def _scaled(self, p: fx.Node, t: fx.Node, st: _State) -> bool:
        """Pattern x * c against the user's x / d: the same when c == 1 / d (c may be a scalar argument)."""
        pa, pc = p.args[0], p.args[1]
        if not isinstance(pa, fx.Node) or isinstance(pc, fx.Node):
            return False
        trial = st.copy()
        trial.bind[p] = t
        trial.interior.append(t)
        if self._node(pa, t.args[0], trial) and self._arg(pc, 1.0 / t.args[1], trial, False):
            st.bind, st.scalars, st.interior = trial.bind, trial.scalars, trial.interior
            return True
        return False

    def _arg(self, pa, ta, st: _State, shape_like: bool) -> bool:
        if isinstance(pa, fx.Node):
            return self._node(pa, ta, st)
        if isinstance(ta, fx.Node):
            return False
        if isinstance(pa, (list, tuple)):
            return isinstance(ta, (list, tuple)) and len(pa) == len(ta) and \
                all(self._arg(a, b, st, shape_like) for a, b in zip(pa, ta))
        if isinstance(pa, (int, float)) and not isinstance(pa, bool) and (type(pa), pa) in self.sentinels:
            # an int argument binds ints only; a float one any number
            if not isinstance(ta, (int, float)) or isinstance(ta, bool) or (isinstance(pa, int) and not isinstance(ta, int)):
                return False
            idx = self.sentinels[(type(pa), pa)]
            return st.scalars.setdefault(idx, ta) == ta
        if shape_like and isinstance(pa, int) and not isinstance(pa, bool):
            return isinstance(ta, int) and not isinstance(ta, bool)
        if isinstance(pa, torch.device) and not self.exact:  # example inputs live on the CPU
            return isinstance(ta, torch.device)
        if type(pa) is not type(ta) and not (isinstance(pa, (int, float)) and isinstance(ta, (int, float))):
            return False
        return pa == ta


def _is_scalar_div(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is aten.div.Tensor and \
        len(node.args) == 2 and isinstance(node.args[1], (int, float)) and not isinstance(node.args[1], bool) \
        and node.args[1] != 0 and not node.kwargs.get("rounding_mode")


def candidates(graph: fx.Graph, target) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target == target]

