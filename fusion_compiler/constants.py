"""Values the graph computes from constants alone (no graph input), evaluated at compile time.

HF builds its eager attention mask in the graph from arange and comparisons: it depends on no input,
so its value is known when the graph is compiled, and a pattern can ask whether it is causal.
"""
from typing import Optional

import torch
import torch.fx as fx

# ops whose result is not a function of their arguments (random draws, uninitialized memory)
_NONDETERMINISTIC = ("rand", "bernoulli", "normal", "uniform", "empty", "dropout", "multinomial", "poisson")
_KEY = "fusion_constant"


def constant_value(node: fx.Node) -> Optional[torch.Tensor]:
    """The real value of `node` if it depends on no graph input and nothing random; else None."""
    if _KEY in node.meta:
        return node.meta[_KEY]
    ancestors, stack = set(), [node]
    value = None
    while stack:
        n = stack.pop()
        if n in ancestors:
            continue
        ancestors.add(n)
        if n.op != "call_function" or any(w in str(n.target) for w in _NONDETERMINISTIC):
            break
        stack.extend(n.all_input_nodes)
    else:
        graph = fx.Graph()
        env = {}
        for n in node.graph.nodes:  # graph order: a node's inputs are copied before it
            if n in ancestors:
                env[n] = graph.node_copy(n, lambda a: env[a])
        graph.output(env[node])
        with torch.no_grad():
            value = fx.GraphModule(torch.nn.Module(), graph)()
    node.meta[_KEY] = value
    return value


def is_causal_mask(mask: torch.Tensor, additive: bool) -> bool:
    """Does the mask keep exactly the positions j <= i of every (Lq = Lk) score matrix? Additive: 0
    where kept and at most half the dtype's lowest value (or -inf) where masked; bool (masked_fill's
    'masked'): True exactly above the diagonal."""
    if mask.dim() < 2 or mask.shape[-1] != mask.shape[-2]:
        return False
    keep = torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).tril()
    if not additive:
        return mask.dtype == torch.bool and bool((mask == ~keep).all())
    if not mask.is_floating_point():
        return False
    low = torch.finfo(mask.dtype).min / 2
    return bool((mask.masked_select(keep.expand_as(mask)) == 0).all()) and \
        bool((mask.masked_select(~keep.expand_as(mask)) <= low).all())
