"""Compile-time values of constant subgraphs, and the causal-mask check."""
import torch

from fusion_compiler.canonical import trace_function
from fusion_compiler.constants import constant_value, is_causal_mask


def _output_node(fn, *args):
    gm = trace_function(fn, list(args))
    return next(n for n in gm.graph.nodes if n.op == "output").args[0]


def test_a_mask_built_from_constants_is_evaluated():
    def causal(x):
        n = x.shape[-1]
        i = torch.arange(n, device=x.device)
        return torch.where(i[None, :] <= i[:, None], 0.0, float("-inf")) + torch.zeros(1, 1, n, n)
    value = constant_value(_output_node(causal, torch.randn(3, 5)))
    assert value.shape == (1, 1, 5, 5) and is_causal_mask(value, additive=True)


def test_values_that_depend_on_inputs_or_randomness_are_not_constants():
    assert constant_value(_output_node(lambda x: x + torch.ones(3), torch.randn(3))) is None
    assert constant_value(_output_node(lambda x: torch.rand(3, 3) + 1, torch.randn(3))) is None


def test_causal_check():
    n = 6
    keep = torch.ones(n, n, dtype=torch.bool).tril()
    finfo_min = torch.zeros(2, 1, n, n).masked_fill(~keep, torch.finfo(torch.float32).min)
    assert is_causal_mask(finfo_min, additive=True)
    assert is_causal_mask(~keep, additive=False)
    window = keep & ~torch.ones(n, n, dtype=torch.bool).tril(-3)  # sliding window of 3
    assert not is_causal_mask(torch.zeros(n, n).masked_fill(~window, float("-inf")), additive=True)
    assert not is_causal_mask(torch.zeros(n, n).masked_fill(~keep, -1.0), additive=True)  # a bias, not a mask
    assert not is_causal_mask(torch.zeros(4, 6), additive=True)  # Lq != Lk
