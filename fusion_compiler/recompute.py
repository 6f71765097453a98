"""Activation recompute for matmul operands (FusionConfig.prefer_memory, training).

A linear's input is saved for its weight gradient. Two such inputs are cheap to make again from
tensors the backward keeps anyway, yet Inductor's partitioner saves them (it never recomputes a
value the backward must materialize):
    a gated or plain activation   act(g) * u,  act(g)          from g, u (its own backward reads them)
    a normalization's output      w * cast(x * rsqrt(...))     from x, the rsqrt and w (likewise)
In the reference Llama step these are the MLP's down-projection input (64 MiB a layer) and the norm
outputs before q/k/v and gate/up (16 MiB each). The pass marks those ATen nodes with the checkpoint
policy PREFER_RECOMPUTE (the tag selective activation checkpointing uses; AOTAutograd copies it into
the joint graph), so the partitioner recomputes them in the backward. The cost is one more write of
the value there; the decision row gives both. Only the regions whose every use is a matmul operand
are marked: a value with another reader would be recomputed for it too.

The marks are node metadata, which Inductor's cache keys leave out: `JointCheck` is the joint-graph
pass whose uuid carries them (a cached graph compiled without the marks is not reused) and which
checks that they arrived.
"""
import hashlib

import torch
import torch.fx as fx

from . import _compat, cost
from .canonical import val
from .decisions import Decision, describe, location

aten = torch.ops.aten
FAMILY = "memory"
MATMULS = (aten.mm.default, aten.addmm.default, aten.bmm.default)
VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default,
         aten.transpose.int, aten.permute.default)
ACTIVATIONS = (aten.silu.default, aten.gelu.default, aten.relu.default, aten.sigmoid.default, aten.tanh.default)
# activations whose backward reads their input: alone (not gated), their output is worth recomputing
# (relu, sigmoid and tanh read their output, which would then be saved in its place)
READ_INPUT = (aten.silu.default, aten.gelu.default)
CAST = aten._to_copy.default


def _is(node, targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _through_casts(node):
    """(the node under any dtype casts, the casts passed)."""
    casts = []
    while _is(node, (CAST,)) and all(not v or k == "dtype" for k, v in node.kwargs.items()):
        casts.append(node)
        node = node.args[0]
    return node, casts


def only_matmul_operands(node: fx.Node) -> bool:
    """Every use of the value (through views) is a matmul's activation operand."""
    if not node.users:
        return False
    for user in node.users:
        if _is(user, VIEWS):
            if not only_matmul_operands(user):
                return False
        elif not (_is(user, MATMULS) and user.args[1 if user.target == aten.addmm.default else 0] is node):
            return False
    return True


def _activation(node: fx.Node):
    """(nodes to recompute, the tensors they are made from) of act(g) * u, u * act(g) or act(g)."""
    if _is(node, READ_INPUT):
        return [node], [node.args[0]]
    if _is(node, (aten.mul.Tensor,)) and all(isinstance(a, fx.Node) for a in node.args):
        for a, b in (node.args, node.args[::-1]):
            act, casts = _through_casts(a)
            if _is(act, ACTIVATIONS) and len(act.users) == 1 and all(len(c.users) == 1 for c in casts):
                return [node, *casts, act], [act.args[0], b]
    return None


def _is_weight(node) -> bool:
    return isinstance(node, fx.Node) and node.op in ("placeholder", "get_attr")


def _norm_output(node: fx.Node):
    """(nodes, sources) of w * cast(x * rsqrt(v)) (either operand order) or cast(x * rsqrt(v))."""
    inner, nodes = _through_casts(node)
    weight = None
    if _is(node, (aten.mul.Tensor,)):
        for w, rest in (node.args, node.args[::-1]):
            cand, casts = _through_casts(rest)
            if _is_weight(w) and _is(cand, (aten.mul.Tensor,)) and len(cand.users) == 1:
                weight, nodes, inner = w, [node, *casts], cand
                break
    if not _is(inner, (aten.mul.Tensor,)):
        return None
    for x, r in (inner.args, inner.args[::-1]):
        if isinstance(x, fx.Node) and _is(r, (aten.rsqrt.default,)):
            x_src, x_casts = _through_casts(x)
            return [*nodes, inner, *x_casts], [x_src, r] + ([weight] if weight is not None else [])
    return None


def mark(gm: fx.GraphModule, log, graph_id: int) -> list:
    """Mark the recomputable matmul operands of a training graph; one decision row each. Returns
    what was marked (for the cache key)."""
    marked = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not isinstance(val(node), torch.Tensor) or not only_matmul_operands(node):
            continue
        for pattern, find in (("recompute_activation", _activation), ("recompute_norm_output", _norm_output)):
            found = find(node)
            if found is None:
                continue
            nodes, sources = found
            for n in nodes:
                n.meta[_compat.RECOMPUTE_META] = _compat.CheckpointPolicy.PREFER_RECOMPUTE
            value = val(node)
            size = value.numel() * value.element_size()
            extra_us = size / cost.profile_for(value.device).bandwidth * 1e6
            reason = (f"less memory, prefer_memory=True: {describe(value)} is recomputed in the backward from "
                      f"{', '.join(s.name for s in sources)} (which it keeps anyway) instead of saved for the "
                      f"matmul's weight gradient: {size / 2**20:.1f} MiB less saved, est. +{extra_us:.1f} us "
                      f"(one more write)")
            log.add(Decision(graph_id, pattern, FAMILY, "applied", reason, location(node),
                             tuple(describe(val(s)) for s in sources), size, -round(extra_us, 2),
                             "checkpoint policy PREFER_RECOMPUTE"))
            marked.append((pattern, node.name, *(n.name for n in nodes)))
            break
    return marked


class JointCheck(_compat.CustomGraphPass):
    """Inductor's joint-graph pass for a graph with marks: its uuid carries them into the cache key,
    and it records a fallback row when none reached the joint graph (the regions are then saved)."""

    def __init__(self, marked: list, log, graph_id: int):
        self.marked, self.log, self.graph_id = marked, log, graph_id

    def __call__(self, graph: fx.Graph) -> None:
        if not any(n.meta.get(_compat.RECOMPUTE_META) is not None for n in graph.nodes):
            self.log.add(Decision(self.graph_id, "recompute", FAMILY, "fallback",
                                  "the recompute marks did not reach the joint graph: the values are saved", "", ()))

    def uuid(self):
        return (_compat.get_hash_for_files((__file__,)), hashlib.sha1(repr(self.marked).encode()).hexdigest())
