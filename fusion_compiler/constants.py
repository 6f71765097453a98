"""Values the graph computes from constants alone (no graph input), evaluated at compile time.

HF builds its eager attention mask in the graph from arange and comparisons: it depends on no input,
so its value is known when the graph is compiled, and a pattern can ask whether it is causal.

example_value(node) also lets graph inputs in, bound to the first call's real inputs (the backend
marks the placeholders with EXAMPLE for the duration of the pass): a hint for cost decisions only
(nanoGPT's causal buffer is an input; its tiles tell FlexAttention's speed), never for legality.
"""
from typing import Optional

import torch
import torch.fx as fx

# ops whose result is not a function of their arguments (random draws, uninitialized memory)
_NONDETERMINISTIC = ("rand", "bernoulli", "normal", "uniform", "empty", "dropout", "multinomial", "poisson")
_KEY = "fusion_constant"
EXAMPLE = "fusion_example"  # placeholder meta: the real input of the call being compiled
MAX_EXAMPLE_ELEMENTS = 1 << 26  # an example value is computed only when every step is this small


def constant_value(node: fx.Node) -> Optional[torch.Tensor]:
    """The real value of `node` if it depends on no graph input and nothing random; else None."""
    if _KEY not in node.meta:
        node.meta[_KEY] = _evaluate(node, inputs_ok=False)
    return node.meta[_KEY]


def release(graph: fx.Graph) -> None:
    """Drop the values constant_value cached on the graph's nodes: they are real tensors (on the GPU for
    a GPU graph), and the graph outlives its compilation (16 MiB a layer for the reference Llama's
    masks, stop 37)."""
    for node in graph.nodes:
        node.meta.pop(_KEY, None)


def example_value(node: fx.Node) -> Optional[torch.Tensor]:
    """The value `node` has on the first call's inputs (computed from them when they are marked and
    the computation is small and deterministic); else None."""
    return constant_value(node) if constant_value(node) is not None else _evaluate(node, inputs_ok=True)


def _evaluate(node: fx.Node, inputs_ok: bool) -> Optional[torch.Tensor]:
    ancestors, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in ancestors:
            continue
        ancestors.add(n)
        if inputs_ok and n.op == "placeholder" and isinstance(n.meta.get(EXAMPLE), torch.Tensor):
            continue
        if n.op != "call_function" or any(w in str(n.target) for w in _NONDETERMINISTIC):
            return None
        v = n.meta.get("val")
        if inputs_ok and isinstance(v, torch.Tensor) and v.numel() > MAX_EXAMPLE_ELEMENTS:
            return None
        stack.extend(n.all_input_nodes)
    graph, env, args = fx.Graph(), {}, []
    for n in node.graph.nodes:  # graph order: a node's inputs are copied before it
        if n in ancestors:
            env[n] = graph.node_copy(n, lambda a: env[a])
            if n.op == "placeholder":
                args.append(n.meta[EXAMPLE])
    graph.output(env[node])
    with torch.no_grad():
        return fx.GraphModule(torch.nn.Module(), graph)(*args)


def is_causal_mask(mask: torch.Tensor, additive: bool, dropped: Optional[float] = None) -> bool:
    """Does the mask keep exactly the positions j <= i of every (Lq = Lk) score matrix? Additive: 0
    where kept and at most `dropped` (default: half the dtype's lowest value, or -inf) where masked;
    bool (masked_fill's 'masked'): True exactly above the diagonal."""
    if mask.dim() < 2 or mask.shape[-1] != mask.shape[-2]:
        return False
    keep = torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).tril()
    if not additive:
        return mask.dtype == torch.bool and bool((mask == ~keep).all())
    if not mask.is_floating_point():
        return False
    low = torch.finfo(mask.dtype).min / 2 if dropped is None else dropped
    return bool((mask.masked_select(keep.expand_as(mask)) == 0).all()) and \
        bool((mask.masked_select(~keep.expand_as(mask)) <= low).all())
