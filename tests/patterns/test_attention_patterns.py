import math

import pytest
import torch

import fusion_compiler as fc
from tests.helpers import check_rewrite, placeholder_with, rel_err


def _qkv(lq=13, lk=13, d=16, dtype=torch.float32, bh=(2, 3)):
    return [torch.randn(*bh, lq, d).to(dtype), torch.randn(*bh, lk, d).to(dtype), torch.randn(*bh, lk, d).to(dtype)]


def _sdpa_called(be):
    names = [str(n.target) for gm in be.rewritten for n in gm.graph.nodes if n.op == "call_function"]
    return any("scaled_dot_product" in n for n in names) and not any("_softmax" in n for n in names)


SPELLINGS = {
    "matmul_times_scale": (lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1) @ v, "attention"),
    "torch_matmul_div_sqrt": (lambda q, k, v: torch.matmul(torch.softmax(
        torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.size(-1)), dim=-1), v), "attention"),
    "prescaled_q": (lambda q, k, v: torch.softmax((q * q.size(-1) ** -0.5) @ k.transpose(-2, -1), -1) @ v,
                    "attention"),
    "softmax_upcast": (lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1, dtype=torch.float32)
                       .to(q.dtype) @ v, "attention"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_unmasked_spellings(spelling, dtype):
    fn, name = SPELLINGS[spelling]
    be = check_rewrite(fn, _qkv(5, 7, dtype=dtype), {name: 1}, dtype, config=fc.FusionConfig(handoff="aot_eager"))
    assert _sdpa_called(be)


def _sdpa_ranks(be):
    return {n.args[0].meta["val"].dim() for gm in be.rewritten for n in gm.graph.nodes
            if "scaled_dot_product" in str(n.target)}


def test_bmm_on_flattened_heads():
    def fn(q, k, v):  # (B*H, L, D)
        return torch.bmm(torch.softmax(torch.bmm(q, k.transpose(1, 2)) * 0.3, dim=-1), v)
    q, k, v = _qkv(5, 7, bh=(6,))
    be = check_rewrite(fn, [q, k, v], {"attention": 1}, config=fc.FusionConfig(handoff="aot_eager"))
    assert _sdpa_ranks(be) == {4}  # SDPA's flash and efficient kernels take (B, H, L, D) only


@pytest.mark.parametrize("bh", [(6,), (2, 3, 2)], ids=["3d", "5d"])
@pytest.mark.parametrize("mask", ["causal", "additive"])
def test_other_ranks_reach_sdpa_as_four_dims(bh, mask):
    n = 9
    bias = torch.randn(*bh[1:], n, n)  # broadcasts over the leading dim

    def fn(q, k, v):
        s = q @ k.transpose(-2, -1) * 0.25
        if mask == "causal":
            s = s.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1), float("-inf"))
        else:
            s = s + bias
        return torch.softmax(s, -1) @ v
    name = "attention_causal" if mask == "causal" else "attention_additive_mask"
    be = check_rewrite(fn, _qkv(n, n, bh=bh), {name: 1}, config=fc.FusionConfig(handoff="aot_eager"))
    assert _sdpa_ranks(be) == {4}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_built_in_graph(dtype):
    def fn(q, k, v):
        n = q.size(-2)
        masked = torch.triu(torch.ones(n, n, dtype=torch.bool, device=q.device), diagonal=1)
        return torch.softmax((q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))).masked_fill(masked, float("-inf")), -1) @ v
    check_rewrite(fn, _qkv(dtype=dtype), {"attention_causal": 1}, dtype, config=fc.FusionConfig(handoff="aot_eager"))


def test_nanogpt_causal_buffer():
    bias = torch.tril(torch.ones(32, 32)).view(1, 1, 32, 32)

    def fn(q, k, v):
        t = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(bias[:, :, :t, :t] == 0, float("-inf"))
        return torch.softmax(att, dim=-1) @ v
    check_rewrite(fn, _qkv(), {"attention_bool_mask": 1}, config=fc.FusionConfig(handoff="aot_eager"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_additive_float_mask_and_gqa_repeat(dtype):
    def fn(q, k, v, mask):  # HF eager: repeat_kv, additive mask, fp32 softmax
        k = k[:, :, None].expand(2, 1, 3, 13, 16).reshape(2, 3, 13, 16)
        v = v[:, :, None].expand(2, 1, 3, 13, 16).reshape(2, 3, 13, 16)
        w = torch.matmul(q, k.transpose(2, 3)) * 0.25 + mask
        return torch.matmul(torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)
    q = torch.randn(2, 3, 13, 16).to(dtype)
    k, v = torch.randn(2, 1, 13, 16).to(dtype), torch.randn(2, 1, 13, 16).to(dtype)
    mask = torch.where(torch.rand(2, 1, 13, 13) > 0.3, 0.0, torch.finfo(dtype).min).to(dtype)
    mask[..., 0] = 0  # no fully masked row
    check_rewrite(fn, [q, k, v, mask], {"attention_additive_mask": 1}, dtype,
                  config=fc.FusionConfig(handoff="aot_eager"))


def _decide(fn, *args):
    be = fc.backend(handoff="aot_eager")
    out = torch.compile(fn, backend=be)(*args)
    return be, out


def test_scores_used_elsewhere_is_a_near_miss():
    def fn(q, k, v):
        s = q @ k.transpose(-2, -1) * 0.25
        return torch.softmax(s, -1) @ v, s.amax()
    be, _ = _decide(fn, *_qkv())
    assert [d.verdict for d in be.log.decisions] == ["near-miss"]


def test_mask_that_depends_on_the_scores_is_a_near_miss():
    def fn(q, k, v):
        s = q @ k.transpose(-2, -1) * 0.25
        return torch.softmax(s.masked_fill(s < 0, float("-inf")), -1) @ v
    be, out = _decide(fn, *_qkv())
    assert "applied" not in [d.verdict for d in be.log.decisions]
    assert not _sdpa_called(be)


def test_wide_head_dim_is_rejected():
    be, _ = _decide(SPELLINGS["matmul_times_scale"][0], *_qkv(d=320))
    [d] = be.log.decisions
    assert d.verdict == "rejected" and "head dim 320" in d.reason


def test_attention_roofline_at_the_anchor_shape():
    """B4 H16 S2048 D128 bf16 causal, training: flash is estimated well ahead of the unfused form
    (anchors on the H100: Inductor 3.23 ms, SDPA 0.72 ms)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fusion_compiler import cost
    from fusion_compiler.matcher import Match
    from fusion_compiler.pattern import registered_patterns

    graph = torch.fx.Graph()

    def node(v):
        return placeholder_with(graph, v)

    with FakeTensorMode():
        q = torch.empty(4, 16, 2048, 128, dtype=torch.bfloat16)
    pat = {p.name: p for p in registered_patterns()}["attention_causal"]
    m = Match(pat, None, [node(q), node(q), node(q), 0.088], [node(q)], [])
    est = cost.estimate_attention(m, cost.CostContext(cost.PROFILES["h100"], "inductor", True), "flash_causal", 0.5)
    assert est.profitable and 0.5e-3 < est.ours_s < 1.0e-3 and 2.5e-3 < est.baseline_s < 4e-3, est


def test_einsum_spelling():
    def fn(q, k, v):
        s = torch.einsum("bhqd,bhkd->bhqk", q, k) * 0.25
        return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s, -1), v)
    check_rewrite(fn, _qkv(5, 7), {"attention": 1}, config=fc.FusionConfig(handoff="aot_eager"))


def test_dropout_becomes_sdpa_dropout_with_the_same_distribution():
    """Eager's and SDPA's random masks differ draw by draw; their expectation is the dropout-free
    attention: the mean of 400 draws lands within a few standard errors of it, while a single draw
    does not (dropout is really applied), and gradients flow."""
    import torch.nn.functional as F

    def fn(q, k, v):
        return F.dropout(torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1), 0.2, True) @ v
    q, k, v = _qkv(6, 6)
    be = fc.backend(handoff="aot_eager")
    f = torch.compile(fn, backend=be)
    ref = torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1) @ v
    draws = torch.stack([f(q, k, v) for _ in range(400)])
    assert (draws.mean(0) - ref).norm() / ref.norm() < 0.05
    assert (draws[0] - ref).norm() / ref.norm() > 0.1
    [d] = be.log.decisions
    assert d.pattern == "attention_dropout" and d.verdict == "applied" and d.inputs[-1] == "0.8"
    qg = q.clone().requires_grad_()
    (g,) = torch.autograd.grad(f(qg, k, v).sum(), qg)
    assert torch.isfinite(g).all() and g.abs().sum() > 0


def _gemma2(q, k, v, mask):  # HF Gemma 2 eager attention with logit soft-capping
    w = torch.matmul(q, k.transpose(2, 3)) * 0.3
    w = w / 50.0
    w = torch.tanh(w)
    w = w * 50.0
    w = w + mask
    return torch.matmul(torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _causal_additive(n):
    return torch.zeros(1, 1, n, n).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))


def _window_additive(n, window):
    i = torch.arange(n)
    keep = (i[:, None] >= i[None]) & (i[:, None] - i[None] < window)
    return torch.zeros(1, 1, n, n).masked_fill(~keep, torch.finfo(torch.float32).min)


def _flex_applied(be, pattern):
    applied = [d for d in be.log.decisions if d.verdict == "applied"]
    assert [d.pattern for d in applied] == [pattern], be.log.decisions
    names = [str(n.target) for gm in be.rewritten for n in gm.graph.nodes]
    assert any("flex_attention" in n for n in names) and "aten._softmax.default" not in names
    return applied[0]


def _gemma2_constant_mask(build):
    def fn(q, k, v):
        return _gemma2(q, k, v, build(q.size(-2)))
    return fn


def _softcap_bool(q, k, v, masked):
    s = torch.tanh(q @ k.transpose(-2, -1) * 0.3 / 30.0) * 30.0
    return torch.softmax(s.masked_fill(masked, float("-inf")), -1) @ v


def _softcap_triu(q, k, v):
    n = q.size(-2)
    masked = torch.triu(torch.ones(n, n, dtype=torch.bool, device=q.device), diagonal=1)
    return _softcap_bool(q, k, v, masked)


SOFTCAP_CASES = {  # name: (fn, extra inputs, the pattern that must apply)
    "gemma2_causal_constant": (_gemma2_constant_mask(_causal_additive), [], "attention_softcap_causal_mask"),
    "gemma2_sliding_constant": (_gemma2_constant_mask(lambda n: _window_additive(n, 5)), [],
                                "attention_softcap_block_mask"),
    "gemma2_mask_input": (_gemma2, [_causal_additive(16)], "attention_softcap_mask"),
    "bool_mask_input": (_softcap_bool, [torch.rand(2, 1, 16, 16) > 0.6], "attention_softcap_bool_mask"),
    "triu_in_graph": (_softcap_triu, [], "attention_softcap_causal"),
}


@pytest.mark.parametrize("case", list(SOFTCAP_CASES))
def test_softcap_becomes_flex_attention_with_the_derived_mods(case):
    fn, extra, pattern = SOFTCAP_CASES[case]
    q, k, v = _qkv(16, 16)
    if case == "bool_mask_input":
        extra[0][..., 0] = False  # no fully masked row
    be = fc.backend(handoff="aot_eager")
    out = torch.compile(fn, backend=be)(q, k, v, *extra)
    ref = fn(q.double(), k.double(), v.double(), *[e.double() if e.is_floating_point() else e for e in extra])
    assert (out.double() - ref).norm() / ref.norm() < 1e-5
    d = _flex_applied(be, pattern)
    assert d.inputs[-2:] in (("0.3", "50.0"), ("0.3", "30.0"))


def test_sliding_window_block_mask_inside_inductor():
    """The block mask reduced in the graph drives Inductor's compiled FlexAttention (which skips the
    tiles): a window of 40 over 300 positions keeps 5 of 9 tile pairs per row at most."""
    def fn(q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) * 0.25 + _window_additive(q.size(-2), 40), -1) @ v
    q, k, v = _qkv(300, 300)
    be = fc.backend(cost_model="always")
    out = torch.compile(fn, backend=be)(q, k, v)
    assert rel_err(out, fn(q.double(), k.double(), v.double())) < 1e-5
    _flex_applied(be, "attention_block_mask")


def _no_diagonal_additive(n):
    i = torch.arange(n)
    return torch.zeros(1, 1, n, n).masked_fill(i[:, None] == i[None], torch.finfo(torch.float32).min)


def test_block_mask_cost_follows_the_tile_density():
    """Roofline: a window of 128 over 2048 positions leaves 12% of the tiles (FlexAttention); a mask
    that only drops the diagonal leaves every tile to compute, and SDPA reading it is estimated
    cheaper (the reason says so)."""
    q, k, v = _qkv(2048, 2048, d=64, bh=(1, 1))
    decided = {}
    for name, build in (("window", lambda n: _window_additive(n, 128)), ("no_diagonal", _no_diagonal_additive)):
        torch.compiler.reset()  # the masks are built in the graph, from constants
        rep = fc.explain(lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1) * 0.25 + build(q.size(-2)), -1) @ v,
                         q, k, v)
        [d] = rep.where(pattern="attention_block_mask")
        decided[name] = d
    assert decided["window"].verdict == "applied" and "12% kept" in decided["window"].reason
    assert decided["no_diagonal"].verdict == "rejected" and "keep SDPA with the mask" in decided["no_diagonal"].reason
    assert rep.where(pattern="attention_additive_mask")[0].verdict == "applied"


def test_nanogpt_buffer_tiles_come_from_the_first_calls_buffer():
    """The buffer is a graph input: its value on the first call is a cost hint. Causal at 2048, half
    of the tiles are empty, so FlexAttention (block mask reduced from the buffer at every call) is
    estimated well ahead of SDPA reading the mask."""
    bias = torch.tril(torch.ones(2048, 2048)).view(1, 1, 2048, 2048)

    def fn(q, k, v, bias):
        t = q.size(-2)
        return torch.softmax((q @ k.transpose(-2, -1) * 0.125).masked_fill(bias[:, :, :t, :t] == 0, float("-inf")),
                             -1) @ v
    rep = fc.explain(fn, *_qkv(2048, 2048, d=64, bh=(1, 1)), bias)
    [d] = rep.where(pattern="attention_block_bool_mask")
    assert d.verdict == "applied" and "53% kept, 6% partial" in d.reason


@pytest.mark.parametrize("spelling", ["repeat_interleave", "expand_reshape"])
def test_gqa_repeats_bind_k_and_v_after_the_repeat(spelling):
    def fn(q, k, v):  # 4 query heads share 2 kv heads
        if spelling == "repeat_interleave":
            k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        else:
            k = k[:, :, None].expand(2, 2, 2, 11, 16).reshape(2, 4, 11, 16)
            v = v[:, :, None].expand(2, 2, 2, 11, 16).reshape(2, 4, 11, 16)
        return torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1) @ v
    q, k, v = torch.randn(2, 4, 11, 16), torch.randn(2, 2, 11, 16), torch.randn(2, 2, 11, 16)
    check_rewrite(fn, [q, k, v], {"attention": 1}, config=fc.FusionConfig(handoff="aot_eager"))


def test_causal_by_where_and_tril_becomes_is_causal():
    """torch.where(tril(ones) keep-mask, scores, -inf): a constant causal mask, so flash's is_causal."""
    def fn(q, k, v):
        n = q.size(-2)
        keep = torch.tril(torch.ones(n, n, dtype=torch.bool, device=q.device))
        return torch.softmax(torch.where(keep, q @ k.transpose(-2, -1) * 0.25, float("-inf")), -1) @ v
    check_rewrite(fn, _qkv(), {"attention_causal_bool_mask": 1}, config=fc.FusionConfig(handoff="aot_eager"))


def test_where_with_the_fill_first_is_a_bool_mask():
    def fn(q, k, v, masked):
        return torch.softmax(torch.where(masked, float("-inf"), q @ k.transpose(-2, -1) * 0.25), -1) @ v
    masked = torch.rand(2, 1, 13, 13) > 0.7
    masked[..., 0] = False  # no fully masked row
    check_rewrite(fn, [*_qkv(), masked], {"attention_bool_mask": 1}, config=fc.FusionConfig(handoff="aot_eager"))


def test_prescaled_q_with_a_causal_mask():
    """q * c before the matmul is canonicalized to a scale after it, so the masked variants take it."""
    def fn(q, k, v):
        n = q.size(-2)
        s = (q * 0.3) @ k.transpose(-2, -1)
        return torch.softmax(s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")), -1) @ v
    check_rewrite(fn, _qkv(), {"attention_causal": 1}, config=fc.FusionConfig(handoff="aot_eager"))


def _alibi_fp32(n, heads):
    slopes = 2.0 ** (-8.0 * torch.arange(1, heads + 1) / heads)
    i = torch.arange(n)
    bias = -(i[:, None] - i[None, :]).clamp(min=0).float() * slopes[:, None, None]
    return bias.masked_fill(i[None, :] > i[:, None], float("-inf"))[None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_alibi_bias_cast_to_the_scores_dtype(dtype):
    """ALiBi built in fp32 and cast to bf16 before the add: the mask binds to the cast value (an fp32
    mask with bf16 scores is not the search function's dtype) and becomes SDPA's additive mask."""
    def fn(q, k, v):
        s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + _alibi_fp32(q.size(-2), q.size(1)).to(q.dtype)
        return torch.softmax(s, -1) @ v
    be = check_rewrite(fn, _qkv(dtype=dtype), {"attention_additive_mask": 1}, dtype,
                       config=fc.FusionConfig(handoff="aot_eager"))
    assert _sdpa_called(be)
    assert not [d for d in be.log.decisions if d.verdict == "fallback"]
