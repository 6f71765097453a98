"""Structural matching: commutativity, transparent casts, scalar binding, exact re-trace verification."""
import torch

import fusion_compiler as fc
from fusion_compiler.canonical import trace_function
from fusion_compiler.matcher import Matcher, candidates


def _match(pattern_fn, examples, target_fn, target_args, exact=False):
    pattern = fc.Pattern("p", "test", pattern_fn, pattern_fn, tuple(examples))
    m = Matcher(pattern.graph(), pattern.scalar_names, exact=exact)
    gm = trace_function(target_fn, target_args)
    found = [m.match(pattern, a) for a in candidates(gm.graph, m.anchor_target)]
    return [f for f in found if f is not None]


def test_commutative_operands_and_scalar_binding():
    pat = lambda x, w, eps: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w  # noqa: E731
    tgt = lambda x, w: w * (torch.rsqrt(1e-3 + (x * x).mean(-1, keepdim=True)) * x)  # noqa: E731
    [m] = _match(pat, [torch.randn(4, 8), torch.randn(8), 1.2345e-5], tgt, [torch.randn(3, 16), torch.randn(16)])
    assert m.inputs[2] == 1e-3
    assert [v.shape for v in m.tensor_inputs()] == [torch.Size([3, 16]), torch.Size([16])]


def test_float_casts_are_transparent_and_bind_the_original_input():
    pat = lambda x: torch.tanh(x) * 2.0  # noqa: E731
    tgt = lambda x: (torch.tanh(x.float()) * 2.0).to(torch.bfloat16)  # noqa: E731
    [m] = _match(pat, [torch.randn(4)], tgt, [torch.randn(4, dtype=torch.bfloat16)])
    assert m.tensor_inputs()[0].dtype == torch.bfloat16


def test_integer_casts_are_not_transparent():
    pat = lambda x: torch.tanh(x) * 2.0  # noqa: E731
    tgt = lambda x: torch.tanh(x.to(torch.int32).float()) * 2.0  # noqa: E731
    [m] = _match(pat, [torch.randn(4)], tgt, [torch.randn(4)])
    assert m.inputs[0].target is torch.ops.aten._to_copy.default  # bound at the int cast, not through it


def test_different_literal_does_not_match():
    pat = lambda x: torch.tanh(x) * 2.0  # noqa: E731
    assert _match(pat, [torch.randn(4)], lambda x: torch.tanh(x) * 3.0, [torch.randn(4)]) == []


def test_size_literals_are_loose_then_verified_exactly():
    def pat(x):
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), -1) * 2.0

    def off_centre(x):
        return torch.cat((-x[..., 3:], x[..., :3]), -1) * 2.0

    x = torch.randn(2, 8)
    [m] = _match(pat, [torch.randn(2, 4)], off_centre, [x])  # loose: matches any bounds
    pattern = fc.Pattern("p", "test", pat, pat, (torch.randn(2, 4),))
    exact = Matcher(pattern.graph_at(m.input_values()), {}, exact=True)
    assert exact.match(pattern, m.anchor) is None  # at 8 wide, rotate_half splits at 4, not 3


def test_escaping_intermediate_is_reported():
    pat = lambda x: torch.tanh(x) * 2.0  # noqa: E731

    def tgt(x):
        t = torch.tanh(x)
        return t * 2.0, t + 1

    [m] = _match(pat, [torch.randn(4)], tgt, [torch.randn(4)])
    inner, user = m.escaping()
    assert inner.target is torch.ops.aten.tanh.default and user.target is torch.ops.aten.add.Tensor
