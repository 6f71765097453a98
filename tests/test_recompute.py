"""Activation recompute under prefer_memory: a norm's output and a gated activation that feed only
matmuls are recomputed in the backward instead of saved (fusion_compiler/recompute.py).

Checked through Inductor on CPU: the tensors the compiled forward saves (saved_tensors_hooks), the
gradients against eager (fp32: reordered reductions only, 1e-5), the decision rows, and the cache key
(the marks are node metadata, which Inductor's caches would otherwise not see)."""
import pytest
import torch
import torch.nn.functional as F

import fusion_compiler as fc
from tests.helpers import rel_err

DIM, FFN, ROWS = 48, 136, 37  # odd sizes


class Block(torch.nn.Module):
    """HF Llama's RMSNorm then its SwiGLU MLP, with a residual."""

    def __init__(self):
        super().__init__()
        self.norm_w = torch.nn.Parameter(torch.rand(DIM) + 0.5)
        self.gate = torch.nn.Linear(DIM, FFN, bias=False)
        self.up = torch.nn.Linear(DIM, FFN, bias=False)
        self.down = torch.nn.Linear(FFN, DIM, bias=False)

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        h = self.norm_w * h.to(x.dtype)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def _saved_bytes(fn, x):
    sizes = []

    def pack(t):
        sizes.append(t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x)
    return y, sum(sizes)


def _run(prefer_memory):
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(ROWS, DIM, requires_grad=True)
    be = fc.backend(prefer_memory=prefer_memory, disable_families={"gemm"})
    compiled = torch.compile(block, backend=be, fullgraph=True)
    y, saved = _saved_bytes(compiled, x)
    y.square().sum().backward()
    grads = [x.grad] + [p.grad for p in block.parameters()]
    return block, be, y, grads, saved


@pytest.fixture(autouse=True)
def _fresh():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def test_norm_output_and_activation_are_recomputed_not_saved():
    _, _, y0, grads0, saved0 = _run(False)
    torch.compiler.reset()
    block, be, y1, grads1, saved1 = _run(True)
    rows = {d.pattern: d for d in be.log.decisions if d.family == "memory"}
    assert rows["recompute_activation"].verdict == "applied", rows
    assert rows["recompute_norm_output"].verdict == "applied", rows
    assert "PREFER_RECOMPUTE" in rows["recompute_activation"].kernel
    # the activation (ROWS x FFN) and the norm output (ROWS x DIM) are no longer saved
    assert saved0 - saved1 == pytest.approx((ROWS * FFN + ROWS * DIM) * 4, rel=0.01), (saved0, saved1)
    assert not any(d.verdict == "fallback" for d in be.log.decisions)
    # against eager, from the same seed
    torch.manual_seed(0)
    ref = Block()
    xr = torch.randn(ROWS, DIM, requires_grad=True)
    out = ref(xr)
    out.square().sum().backward()
    assert rel_err(y1, out) < 1e-5
    for g, r in zip(grads1, [xr.grad] + [p.grad for p in ref.parameters()]):
        assert rel_err(g, r) < 1e-5


def test_without_prefer_memory_nothing_is_marked_and_the_norm_is_ours_to_decide():
    _, be, *_ = _run(False)
    assert not [d for d in be.log.decisions if d.family == "memory"]


def test_prefer_memory_keeps_the_norm_on_inductor_when_its_output_feeds_matmuls():
    _, be, *_ = _run(True)
    norms = [d for d in be.log.decisions if d.family == "norm"]
    assert norms and all(d.verdict == "rejected" and "recomputed in the backward" in d.reason for d in norms)


def test_value_with_another_reader_is_not_marked():
    class TwoReaders(Block):
        def forward(self, x):
            a = F.silu(self.gate(x)) * self.up(x)
            return self.down(a) + a.sum(-1, keepdim=True)
    torch.manual_seed(0)
    be = fc.backend(prefer_memory=True, disable_families={"gemm"})
    x = torch.randn(ROWS, DIM, requires_grad=True)
    torch.compile(TwoReaders(), backend=be)(x).sum().backward()
    assert not [d for d in be.log.decisions if d.pattern == "recompute_activation"]


def test_marks_are_in_inductors_cache_key():
    with torch._inductor.config.patch(fx_graph_cache=True):
        _, _, _, _, saved_plain = _run(False)
        torch.compiler.reset()
        _, _, _, _, saved_marked = _run(True)
    assert saved_marked < saved_plain  # not the cached graph of the unmarked compile


@pytest.mark.parametrize("act, marked", [(F.gelu, True), (F.relu, False)])
def test_a_plain_activation_is_marked_only_when_its_backward_reads_its_input(act, marked):
    class Plain(Block):
        def forward(self, x):
            return self.down(act(self.gate(x)))
    torch.manual_seed(0)
    be = fc.backend(prefer_memory=True, disable_families={"gemm"})
    model = Plain()
    x = torch.randn(ROWS, DIM, requires_grad=True)
    y, saved = _saved_bytes(torch.compile(model, backend=be), x)
    y.square().sum().backward()
    rows = [d for d in be.log.decisions if d.pattern == "recompute_activation"]
    assert bool(rows) == marked
    xr = x.detach().clone().requires_grad_()
    ref = model.down(act(model.gate(xr)))
    assert rel_err(y, ref) < 1e-5
    ref.square().sum().backward()
    assert rel_err(x.grad, xr.grad) < 1e-5


def test_other_handoffs_get_no_marks():
    torch.manual_seed(0)
    be = fc.backend(prefer_memory=True, disable_families={"gemm"}, handoff="aot_eager")
    x = torch.randn(ROWS, DIM, requires_grad=True)
    torch.compile(Block(), backend=be)(x).sum().backward()
    assert not [d for d in be.log.decisions if d.family == "memory"]
