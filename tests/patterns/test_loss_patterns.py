import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fusion_compiler as fc
from tests.helpers import check_rewrite


def _target(n=13, v=77):
    t = torch.randint(0, v, (n,))
    t[[0, 7]] = -100
    return t


SPELLINGS = {
    "cross_entropy_mean": lambda x, t: F.cross_entropy(x, t),
    "cross_entropy_sum": lambda x, t: nn.CrossEntropyLoss(reduction="sum")(x, t),
    "cross_entropy_none": lambda x, t: F.nll_loss(F.log_softmax(x, dim=-1), t, reduction="none"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(SPELLINGS))
def test_cross_entropy_spellings(name, dtype):
    check_rewrite(SPELLINGS[name], [torch.randn(13, 77).to(dtype), _target()], {name: 1}, dtype)


def test_hf_causal_lm_spelling_reads_the_logits_in_their_dtype():
    """HF: upcast to fp32, shift the labels, flatten: the fp32 copy is not materialized."""
    def lm_loss(logits, labels):
        logits = logits.float()
        labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    labels = torch.randint(0, 77, (2, 9))
    be = check_rewrite(lm_loss, [torch.randn(2, 9, 77).to(torch.bfloat16), labels], {"cross_entropy_mean": 1},
                       torch.bfloat16)
    assert be.log.decisions[0].inputs[0] == "bf16[18, 77]"


def test_log_softmax_used_elsewhere_is_a_near_miss():
    def fn(x, t):
        logp = F.log_softmax(x, dim=-1)
        return F.nll_loss(logp, t), logp.exp().amax()
    be = fc.backend(handoff="aot_eager", cost_model="always")
    torch.compile(fn, backend=be)(torch.randn(13, 77), _target())
    assert [d.verdict for d in be.log.decisions] == ["near-miss"]


def test_any_ignore_index_binds():
    t = torch.randint(0, 77, (13,))
    t[[1, 4]] = 3  # a pad token id as the ignored class
    be = check_rewrite(lambda x, t: F.cross_entropy(x, t, ignore_index=3), [torch.randn(13, 77), t],
                       {"cross_entropy_mean": 1})
    assert be.log.decisions[0].inputs[-1] == "3"


def test_float64_stays_eager():
    be = fc.backend(handoff="aot_eager", cost_model="always")
    torch.compile(SPELLINGS["cross_entropy_mean"], backend=be)(torch.randn(13, 77, dtype=torch.float64), _target())
    [d] = be.log.decisions
    assert d.verdict == "rejected" and "float64" in d.reason


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_label_smoothing_in_the_graph(reduction):
    fn = lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1, reduction=reduction)  # noqa: E731
    check_rewrite(fn, [torch.randn(13, 77), _target()], {f"cross_entropy_smoothed_{reduction}": 1})


def test_smoothing_scalars_that_disagree_are_rejected():
    """(1 - eps) * nll + c * smooth with c != eps / V is not a label smoothing."""
    def fn(x, t):
        lsm = torch.log_softmax(x, -1)
        ignored = t == -100
        smooth = (-lsm.sum(-1)).masked_fill(ignored, 0.0).sum() / (~ignored).sum()
        return F.nll_loss(lsm, t) * 0.9 + smooth * 0.5
    be = fc.backend(handoff="aot_eager", cost_model="always")
    x, t = torch.randn(13, 77), _target()
    out = torch.compile(fn, backend=be)(x, t)
    d = next(d for d in be.log.decisions if d.pattern == "cross_entropy_smoothed_mean")
    assert d.verdict == "rejected" and "not 1 - eps" in d.reason
    torch.testing.assert_close(out, fn(x, t))


def _lm_head_loss(h, w, labels, b=None, cap=None, reduction="mean"):
    """HF causal-LM head + loss: 3-D hidden states, the LM head, optional soft-cap, fp32 upcast, shift."""
    logits = F.linear(h, w, b)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    logits = logits.float()
    labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                           reduction=reduction)


LINEAR_CASES = {  # name: (bias, cap, reduction)
    "linear_cross_entropy_mean": (False, None, "mean"),
    "linear_cross_entropy_sum": (False, None, "sum"),
    "linear_bias_cross_entropy_mean": (True, None, "mean"),
    "linear_softcap_cross_entropy_mean": (False, 7.0, "mean"),
    "linear_bias_softcap_cross_entropy_sum": (True, 7.0, "sum"),
    "linear_cross_entropy_none": (False, None, "none"),
    "linear_bias_softcap_cross_entropy_none": (True, 7.0, "none"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(LINEAR_CASES))
def test_linear_cross_entropy_spellings(name, dtype):
    bias, cap, reduction = LINEAR_CASES[name]
    labels = torch.randint(0, 77, (2, 9))
    labels[0, 3] = -100
    args = [torch.randn(2, 9, 16).to(dtype), (torch.randn(77, 16) / 4).to(dtype), labels]
    if bias:
        args.append(torch.randn(77).to(dtype))

    def fn(h, w, labels, b=None):
        return _lm_head_loss(h, w, labels, b, cap, reduction)
    check_rewrite(fn, args, {name: 1}, dtype, factor=2)


def _lm_loss_and_logits(h, w, labels):
    """HF's causal LM: the loss of the logits, and the logits returned too."""
    logits = F.linear(h, w)
    labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1)), logits


def test_returned_logits_are_a_near_miss_that_names_the_switch():
    fn = _lm_loss_and_logits
    h, w = torch.randn(2, 9, 16, requires_grad=True), torch.randn(77, 16, requires_grad=True)
    be = fc.backend(handoff="aot_eager", cost_model="always")
    torch.compile(fn, backend=be)(h, w, torch.randint(0, 77, (2, 9)))
    d = next(d for d in be.log.decisions if d.pattern == "linear_cross_entropy_mean")
    assert d.verdict == "near-miss" and "drop_logits=True" in d.reason


def test_drop_logits_returns_an_empty_tensor_and_keeps_loss_and_gradients():
    """HF returns the logits beside the loss; with drop_logits the loss and every gradient match
    eager, the logits come back empty, and the tied weight (embedding and LM head) gets both uses'
    gradients."""
    emb = torch.randn(77, 16, requires_grad=True)

    def fn(ids, labels, w):
        h = torch.tanh(F.embedding(ids, w))
        logits = F.linear(h, w)  # tied: the embedding's weight is the LM head's
        loss = F.cross_entropy(logits.float().view(-1, 77), F.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1))
        return loss, logits
    ids = torch.randint(0, 77, (2, 9))
    be = fc.backend(handoff="aot_eager", cost_model="always", drop_logits=True)
    loss, logits = torch.compile(fn, backend=be)(ids, ids, emb)
    (grad,) = torch.autograd.grad(loss, emb)
    w64 = emb.detach().double().requires_grad_()
    ref_loss, ref_logits = fn(ids, ids, w64)
    (ref_grad,) = torch.autograd.grad(ref_loss, w64)
    assert logits.numel() == 0 and ref_logits.numel() > 0
    assert abs(loss.item() - ref_loss.item()) < 1e-5 * ref_loss.item()
    assert (grad.double() - ref_grad).norm() / ref_grad.norm() < 1e-5
    d = next(d for d in be.log.decisions if d.verdict == "applied")
    assert d.pattern == "linear_cross_entropy_mean" and "returned logits dropped" in d.reason


def test_drop_logits_keeps_the_logits_in_inference():
    be = fc.backend(handoff="aot_eager", cost_model="always", drop_logits=True)
    with torch.no_grad():
        loss, logits = torch.compile(_lm_loss_and_logits, backend=be)(
            torch.randn(2, 9, 16), torch.randn(77, 16), torch.randint(0, 77, (2, 9)))
    assert logits.shape == (2, 9, 77)
    d = next(d for d in be.log.decisions if d.pattern == "linear_cross_entropy_mean")
    assert d.verdict == "near-miss" and "drop_logits=True" in d.reason


@pytest.mark.parametrize("vocab, default", [(32000, False), (128256, False)])
def test_linear_cross_entropy_cost_is_measured_and_memory_needs_the_switch(vocab, default):
    """H200 measurements: the chunked op ties Inductor at 32K and is 8% slower at 128K for half the
    memory; the roofline takes neither by default (no speed win beyond the margin) and both with
    prefer_memory, saying what it trades."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fusion_compiler import cost
    from fusion_compiler.matcher import Match
    from fusion_compiler.pattern import registered_patterns
    from tests.helpers import placeholder_with

    graph = torch.fx.Graph()
    with FakeTensorMode():
        h, w = torch.empty(4096, 2048, dtype=torch.bfloat16), torch.empty(vocab, 2048, dtype=torch.bfloat16)
        t = torch.empty(4096, dtype=torch.int64)
    pat = {p.name: p for p in registered_patterns()}["linear_cross_entropy_mean"]
    m = Match(pat, None, [placeholder_with(graph, v) for v in (h, w, t)] + [-100], [], [])
    plain = cost.estimate_linear_cross_entropy(m, cost.CostContext(cost.PROFILES["h200"], "inductor", True))
    trade = cost.estimate_linear_cross_entropy(m, cost.CostContext(cost.PROFILES["h200"], "inductor", True, True))
    assert plain.profitable is default and "fwd+bwd measured on h200" in plain.reason()
    assert trade.profitable and "less memory, prefer_memory=True" in trade.reason()
    assert "GiB less peak memory" in trade.reason()


@pytest.mark.parametrize("bias, softcap", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy_with_label_smoothing(reduction, bias, softcap):
    def fn(h, w, b, t):
        logits = F.linear(h, w, b if bias else None)
        if softcap:
            logits = torch.tanh(logits / 5.0) * 5.0
        return F.cross_entropy(logits, t, label_smoothing=0.1, reduction=reduction)
    name = "linear_" + "bias_" * bias + "softcap_" * softcap + f"cross_entropy_smoothed_{reduction}"
    check_rewrite(fn, [torch.randn(13, 16), torch.randn(77, 16) / 4, torch.randn(77), _target()], {name: 1})


def test_linear_cross_entropy_float64_stays_eager():
    def fn(h, w, t):
        return F.cross_entropy(F.linear(h, w), t)
    h, w, t = torch.randn(13, 16, dtype=torch.float64), torch.randn(77, 16, dtype=torch.float64), _target()
    be = fc.backend(handoff="aot_eager", cost_model="always")
    out = torch.compile(fn, backend=be)(h, w, t)
    d = next(d for d in be.log.decisions if d.pattern == "linear_cross_entropy_mean")
    assert d.verdict == "rejected" and "float64" in d.reason
    assert not any(d.verdict == "applied" for d in be.log.decisions)
    torch.testing.assert_close(out, fn(h, w, t))


def test_logits_returned_directly_name_the_switch():
    """The logits returned as they are (no view on the way out) also get the drop_logits hint."""
    def fn(h, w, t):
        logits = F.linear(h, w)
        return F.cross_entropy(logits, t), logits
    h, w = torch.randn(13, 16, requires_grad=True), torch.randn(77, 16, requires_grad=True)
    be = fc.backend(handoff="aot_eager", cost_model="always")
    torch.compile(fn, backend=be)(h, w, _target())
    d = next(d for d in be.log.decisions if d.pattern == "linear_cross_entropy_mean")
    assert d.verdict == "near-miss" and "drop_logits=True" in d.reason


@pytest.mark.parametrize("chunk_rows", [None, 64])
def test_per_token_losses_weighted_then_summed(chunk_rows, monkeypatch):
    """Reduction none (e.g. per-token weights): the backward runs the chunks again, each row scaled by
    its own incoming gradient; with 64-row chunks over 150 tokens the last chunk is partial."""
    from fusion_compiler.codegen import linear_cross_entropy as lce
    if chunk_rows:
        monkeypatch.setattr(lce, "CHUNK_BYTES", chunk_rows * 77 * 4)
    weights = torch.rand(150)

    def fn(h, w, b, t):
        return (F.cross_entropy(F.linear(h, w, b), t, reduction="none") * weights).sum()
    check_rewrite(fn, [torch.randn(150, 16), torch.randn(77, 16) / 4, torch.randn(77), _target(150)],
                  {"linear_bias_cross_entropy_none": 1})


def test_per_token_losses_of_an_all_ignored_batch_are_zero_with_zero_gradients():
    t = torch.full((13,), -100)
    h, w = torch.randn(13, 16, requires_grad=True), torch.randn(77, 16, requires_grad=True)
    be = fc.backend(handoff="aot_eager", cost_model="always")
    out = torch.compile(lambda h, w, t: F.cross_entropy(F.linear(h, w), t, reduction="none"), backend=be)(h, w, t)
    assert torch.equal(out, torch.zeros(13))
    gh, gw = torch.autograd.grad(out, (h, w), torch.randn(13))
    assert not gh.any() and not gw.any()
    assert [d.pattern for d in be.log.decisions if d.verdict == "applied"] == ["linear_cross_entropy_none"]


def test_per_token_cost_counts_the_second_logits_gemm():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fusion_compiler import cost
    from fusion_compiler.matcher import Match
    from fusion_compiler.pattern import registered_patterns
    from tests.helpers import placeholder_with

    graph = torch.fx.Graph()
    with FakeTensorMode():
        h, w = torch.empty(4096, 2048, dtype=torch.bfloat16), torch.empty(128256, 2048, dtype=torch.bfloat16)
        t = torch.empty(4096, dtype=torch.int64)
    pats = {p.name: p for p in registered_patterns()}
    ctx = cost.CostContext(cost.PROFILES["h200"], "inductor", True, True)
    est = {r: cost.estimate_linear_cross_entropy(
        Match(pats[f"linear_cross_entropy_{r}"], None, [placeholder_with(graph, v) for v in (h, w, t)] + [-100], [], []),
        ctx) for r in ("mean", "none")}
    assert est["none"].ours_s == pytest.approx(est["mean"].ours_s * 4 / 3)
    assert "second logits GEMM" in est["none"].reason()
