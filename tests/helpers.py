"""Numerics and compile helpers shared by the tests.

Tolerances on ||out - ref|| / ||ref|| against a float64 reference (DESIGN.md, "Numerics"):
fp32 1e-5 (fp32 arithmetic, reductions reordered); fp16 2e-3 (one rounding of the output, ~5e-4,
plus input rounding); bf16 1.5e-2 (8-bit mantissa: each cast rounds by up to 2^-9, and a kernel
rounds its inputs, intermediates saved for the backward and its output).
"""
import torch

import fusion_compiler as fc

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    assert not torch.isnan(out).any(), "NaN in output (an unwritten, poisoned element?)"
    denom = ref.norm().item()
    return (out - ref).norm().item() / (denom if denom > 0 else 1.0)


def assert_close(out, ref, dtype, what="", factor=1.0):
    err = rel_err(out, ref)
    assert err <= TOL[dtype] * factor, f"{what}: relative error {err:.2e} > {TOL[dtype] * factor:.1e} ({dtype})"


def _cast(t, dtype):
    if dtype is None or not (t.is_floating_point() or t.is_complex()):
        return t
    if t.is_complex():
        return t.to(torch.complex128 if dtype == torch.float64 else t.dtype)
    return t.to(dtype)


def leaves(*tensors, dtype=None):
    """Fresh leaf copies (floating ones optionally cast; complex ones to complex128 with float64)."""
    return [_cast(t.detach(), dtype).clone().requires_grad_(t.is_floating_point()) for t in tensors]


def outputs(o):
    return list(o) if isinstance(o, (tuple, list)) else [o]


def fusion_ops(backend: fc.FusionBackend) -> list[str]:
    """Names of the fusion ops in every graph the backend handed off."""
    return [n.target.name() for gm in backend.rewritten for n in gm.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("fusion.")]


def check_rewrite(fn, args, expect: dict, dtype=torch.float32, config=None, factor=1.0):
    """Compile fn with the fusion backend (rewrites forced on), compare outputs and every gradient
    with eager fn in float64, and assert the pattern counts in `expect` were applied."""
    config = config or fc.FusionConfig(handoff="aot_eager", cost_model="always")
    be = fc.FusionBackend(config)
    ours = leaves(*args)
    ref = leaves(*args, dtype=torch.float64) if dtype != torch.float64 else leaves(*args)
    out = outputs(torch.compile(fn, backend=be)(*ours))
    want = outputs(fn(*ref))
    eager = outputs(fn(*leaves(*args)))
    assert len(out) == len(want) == len(eager)
    for o, w, e in zip(out, want, eager):
        assert o.dtype == e.dtype and o.shape == e.shape, f"{o.dtype}{o.shape} vs eager {e.dtype}{e.shape}"
        assert_close(o, w, dtype, "forward", factor)
    grads = [torch.randn(w.shape, dtype=torch.float64) for w in want]
    gi = [t for t in ours if t.requires_grad]
    gr = [t for t in ref if t.requires_grad]
    d_ours = torch.autograd.grad(out, gi, [g.to(o.dtype) for g, o in zip(grads, out)], allow_unused=True)
    d_ref = torch.autograd.grad(want, gr, grads, allow_unused=True)
    for i, (a, b) in enumerate(zip(d_ours, d_ref)):
        assert (a is None) == (b is None), f"gradient {i} missing on one side"
        if a is not None:
            assert_close(a, b, dtype, f"grad of input {i}", factor)
    applied = {}
    for d in be.log.decisions:
        if d.verdict == "applied":
            applied[d.pattern] = applied.get(d.pattern, 0) + 1
    assert applied == expect, f"applied {applied}, expected {expect}\n{fc.Report(be.log.decisions)}"
    return be


def placeholder_with(graph, value):
    """A placeholder in `graph` carrying `value` as its meta['val'] (to build Matches by hand)."""
    node = graph.placeholder(f"p{len(graph.nodes)}")
    node.meta["val"] = value
    return node
