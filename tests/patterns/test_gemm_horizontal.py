"""Horizontal GEMM fusion: linears sharing their input become one GEMM over concatenated weights;
forward and every gradient (each weight's, the input's) match float64 eager; a part that is returned
keeps its layout (the group is left alone); the cost model decides by launches, tile waves and the
concatenation's copies."""
import dataclasses

import torch
import torch.nn.functional as F

import fusion_compiler as fc
from fusion_compiler import cost
from tests.helpers import check_rewrite

ALWAYS = fc.FusionConfig(handoff="aot_eager", cost_model="always")


def _rows(be):
    return [d for d in be.log.decisions if d.pattern == "gemm_horizontal"]


def qkv_attention_like(x, wq, wk, wv):
    """HF-style projections: each part viewed into heads and transposed."""
    q = F.linear(x, wq).view(2, 13, 4, 8).transpose(1, 2)
    k = F.linear(x, wk).view(2, 13, 2, 8).transpose(1, 2)
    v = F.linear(x, wv).view(2, 13, 2, 8).transpose(1, 2)
    return ((q.sum(1, keepdim=True) * k).sum(-1, keepdim=True) * v).sum(1)


def test_qkv_projections_become_one_gemm():
    args = [torch.randn(2, 13, 24), torch.randn(32, 24), torch.randn(16, 24), torch.randn(16, 24)]
    be = check_rewrite(qkv_attention_like, args, {"gemm_horizontal": 1})
    [row] = _rows(be)
    assert "3 linears as one GEMM" in row.reason
    graph = be.rewritten[0].graph
    assert sum(n.target is torch.ops.aten.mm.default for n in graph.nodes) == 1
    assert any(n.target is torch.ops.aten.cat.default for n in graph.nodes)


def test_gate_and_up_with_biases_feed_the_glu_op():
    """Two addmm's (biases concatenated too) whose strided parts feed fusion::glu."""
    def mlp(x, wg, bg, wu, bu, wd):
        return F.linear(F.silu(F.linear(x, wg, bg)) * F.linear(x, wu, bu), wd)
    args = [torch.randn(3, 7, 20), torch.randn(36, 20), torch.randn(36), torch.randn(36, 20), torch.randn(36),
            torch.randn(20, 36)]
    be = check_rewrite(mlp, args, {"gemm_horizontal": 1, "glu_silu": 1})
    assert len(_rows(be)) == 1


def test_a_returned_part_keeps_its_layout():
    def fn(x, wq, wk):
        q = F.linear(x, wq)
        return q, F.linear(x, wk).relu().sum()
    be = fc.FusionBackend(fc.FusionConfig(handoff="aot_eager", cost_model="always", families="gemm",
                                          disable_patterns="gemm_epilogue"))
    x, wq, wk = torch.randn(5, 12), torch.randn(8, 12), torch.randn(8, 12)
    q, s = torch.compile(fn, backend=be)(x, wq, wk)
    assert q.stride() == (8, 1)
    torch.testing.assert_close(q, F.linear(x, wq))
    [row] = _rows(be)
    assert row.verdict == "rejected" and "is returned and would change its strides" in row.reason


def test_different_inputs_or_dtypes_are_not_grouped():
    def fn(x, y, w1, w2, w3):
        return F.linear(x, w1).sum() + F.linear(y, w2).sum() + F.linear(x.double(), w3.double()).sum()
    be = fc.FusionBackend(ALWAYS)
    torch.compile(fn, backend=be)(torch.randn(4, 6), torch.randn(4, 6), torch.randn(3, 6), torch.randn(3, 6),
                                  torch.randn(3, 6))
    assert _rows(be) == []


def _estimate(m, k, ns, training, dtype=torch.bfloat16):
    a = torch.empty(m, k, dtype=dtype, device="meta")
    ws = [torch.empty(n, k, dtype=dtype, device="meta") for n in ns]
    return cost.estimate_horizontal(a, ws, cost.CostContext(cost.PROFILES["h200"], "inductor", training))


def test_cost_model():
    """Small products are launch-bound: one launch pays. The reference Llama's q/k/v (4096 tokens,
    2048 -> 2048/512/512) already fill their tile waves; in training the concatenations (weights,
    output gradients) are weighed against the input gradients' sum that one GEMM avoids."""
    assert _estimate(256, 512, [512, 128, 128], training=False).profitable
    big = _estimate(4096, 2048, [2048, 512, 512], training=True)
    assert "wave fill 0.97 vs 0.97" in big.reason() and big.ours_bytes == 72 * 2**20


def test_roofline_keeps_separate_gemms_where_timed_slower_or_not_timed(monkeypatch):
    """Timed on the H200 (Llama reference layer): 5% slower forward, 1.4% fwd+bwd; a card without a
    timing keeps them too."""
    args = [torch.randn(2, 13, 24), torch.randn(32, 24), torch.randn(16, 24), torch.randn(16, 24)]
    be = fc.FusionBackend(fc.FusionConfig(handoff="aot_eager"))
    torch.compile(qkv_attention_like, backend=be)(*args)
    [row] = _rows(be)
    assert row.verdict == "rejected" and "timed on h200: the Llama reference layer ran x1.0" in row.reason
    monkeypatch.setitem(cost.PROFILES, "h200", dataclasses.replace(cost.PROFILES["h200"], horizontal=()))
    torch.compiler.reset()
    be = fc.FusionBackend(fc.FusionConfig(handoff="aot_eager"))
    torch.compile(qkv_attention_like, backend=be)(*args)
    [row] = _rows(be)
    assert row.verdict == "rejected" and "not yet timed on h200" in row.reason
