"""SDPA calls with a causal mask known at compile time become is_causal, and repeat_kv'd keys/values go in
unrepeated (patterns/sdpa_causal.py): outputs and every gradient against float64 eager, masks that must
stay (built from a graph input, not causal, keys longer than queries), and HF Llama as HF builds it
under torch.compile on torch < 2.14 (the mask materialized, k and v repeated)."""
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import fusion_compiler as fc
from fusion_compiler import constants
from tests.helpers import check_rewrite
from tests.models.test_hf_models import train_both_and_compare


def repeat_kv(x, n):
    """HF's spelling."""
    b, kv, s, d = x.shape
    return x[:, :, None, :, :].expand(b, kv, n, s, d).reshape(b, kv * n, s, d)


def qkv(lq=13, lk=13, heads=4, kv=2, d=24, b=2):
    return torch.randn(b, heads, lq, d), torch.randn(b, kv, lk, d), torch.randn(b, kv, lk, d)


def bool_causal(q, k, v):
    keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), attn_mask=keep)


def additive_causal(q, k, v):
    """HF's construction: a bool mask from aranges, broadcast over the batch, then 0 / -inf."""
    length = q.shape[-2]
    i = torch.arange(length, device=q.device)
    keep = (i[None, :] <= i[:, None])[None, None].expand(q.shape[0], 1, length, length)
    mask = torch.where(keep, 0.0, float("-inf")).to(q.dtype)
    return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), attn_mask=mask, scale=0.3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fn", [bool_causal, additive_causal])
def test_constant_causal_mask_becomes_is_causal(fn, dtype):
    be = check_rewrite(fn, qkv(), {"sdpa_causal_mask": 1}, dtype=dtype)
    d = be.log.decisions[-1]
    assert "mask -> is_causal; k/v unrepeated (enable_gqa, 2 query heads a kv head)" in d.reason, d.reason
    graph = be.rewritten[-1].graph
    sdpa = [n for n in graph.nodes if "scaled_dot_product" in str(n.target)]
    assert len(sdpa) == 1 and sdpa[0].kwargs.get("attn_mask") is None
    # the unrepeated k and v are read: no expand is left in the graph; the mask's value evaluated at
    # compile time is not kept on the graph (a real tensor, on the GPU for a GPU graph)
    assert not any(n.target is torch.ops.aten.expand.default for n in graph.nodes)
    assert not any(constants._KEY in n.meta for n in graph.nodes)


def test_is_causal_with_repeated_kv_is_unrepeated():
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, repeat_kv(k, 4), repeat_kv(v, 4), is_causal=True)
    be = check_rewrite(fn, qkv(lq=9, lk=9, heads=8, kv=2, d=16), {"sdpa_causal_mask": 1})
    assert "is_causal kept; k/v unrepeated (enable_gqa, 4 query heads a kv head)" in be.log.decisions[-1].reason


def _rejected(fn, args, why):
    be = check_rewrite(fn, args, {})
    rows = [d for d in be.log.decisions if d.pattern == "sdpa_causal_mask"]
    assert len(rows) == 1 and rows[0].verdict == "rejected" and why in rows[0].reason, fc.Report(be.log.decisions)


def test_masks_that_must_stay():
    def from_input(q, k, v, keep):
        return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), attn_mask=keep)

    def window(q, k, v):
        ones = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=ones.tril() & ones.triu(-3))

    def longer_keys(q, k, v):
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)

    keep = torch.ones(13, 13, dtype=torch.bool).tril()  # causal, but a graph input: may change per call
    _rejected(from_input, [*qkv(), keep], "computed from graph inputs")
    _rejected(window, qkv(kv=4), "is not causal")
    _rejected(longer_keys, qkv(lq=7, lk=11, kv=4), "query length 7 != key length 11")


def test_disabled_by_name():
    config = fc.FusionConfig(handoff="aot_eager", cost_model="always", disable_patterns={"sdpa_causal_mask"})
    be = check_rewrite(bool_causal, qkv(), {}, config=config)
    assert not be.log.decisions


def test_hf_llama_with_its_compiled_mask_trains_as_eager(monkeypatch):
    """HF transformers skips its is_causal shortcut while compiling on torch < 2.14 (the GPU machine's
    2.11): it then hands SDPA a causal mask and repeat_kv'd k/v. Forced here on the CPU's 2.13."""
    import transformers.masking_utils as masking
    monkeypatch.setattr(masking, "_ignore_causal_mask_sdpa", lambda *args, **kwargs: False)
    layers = 2
    make = lambda: LlamaForCausalLM(LlamaConfig(  # noqa: E731
        vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa"))
    be = fc.backend(handoff="aot_eager", families={"attention"})
    train_both_and_compare(make, be)
    rows = [d for d in be.log.decisions if d.pattern == "sdpa_causal_mask"]
    assert [d.verdict for d in rows] == ["applied"] * layers, fc.Report(be.log.decisions)
    assert all("mask -> is_causal; k/v unrepeated" in d.reason and d.location.startswith("sdpa_attention.py:")
               for d in rows), fc.Report(be.log.decisions)


@pytest.mark.parametrize("dropped, taken", [(-65504.0, True), (-1e4, False)])
def test_cudnn_style_large_negative_mask(dropped, taken):
    """torch hands cuDNN a bool mask as 0 / -65504 (not -inf): that still drops every masked score; a
    smaller negative (-1e4) is a bias, not a mask, and stays."""
    def fn(q, k, v):
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.where(keep, 0.0, dropped))
    if taken:
        check_rewrite(fn, qkv(kv=4), {"sdpa_causal_mask": 1})
    else:
        _rejected(fn, qkv(kv=4), "is not causal (float32, values -10000, 0")


@pytest.mark.parametrize("fault", ["wrong", "raises"])
def test_a_new_call_that_fails_its_check_keeps_the_mask(monkeypatch, fault):
    """verify_kernels (on by default) runs the traced new call once on random data of the signature and
    compares it with the masked call: a kernel that raises or gives another answer is not used."""
    from fusion_compiler.patterns import sdpa_causal

    monkeypatch.setattr(sdpa_causal, "_causal_sdpa", lambda dropout_p, scale, gqa, order: _broken(fault, scale, gqa))
    monkeypatch.setattr(sdpa_causal, "_CHECKED", {})
    why = "differs from the masked one on random data" if fault == "wrong" else "failed on this signature"
    _rejected(bool_causal, qkv(), "torch order: the new call " + why)


def _broken(fault, scale, gqa):
    def attend(q, k, v):
        if fault == "raises":  # traces (its meta kernel), has no CPU kernel to run
            k, v = repeat_kv(k, 2), repeat_kv(v, 2)
            return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, False,
                                                                       is_causal=True)[0].contiguous()
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)  # not causal
    return attend


def test_a_backend_order_that_fails_its_check_gives_way_to_the_next(monkeypatch):
    """On Hopper the new call tries cuDNN's attention first, then torch's own order: here the first
    order's traced call cannot run, and the second's is used, with the first's failure in the row."""
    from fusion_compiler.patterns import sdpa_causal

    first = object()
    working = sdpa_causal._causal_sdpa
    monkeypatch.setattr(sdpa_causal, "_orders", lambda device: [first, None])
    monkeypatch.setattr(sdpa_causal, "_causal_sdpa", lambda dropout_p, scale, gqa, order: (
        _broken("raises", scale, gqa) if order is first else working(dropout_p, scale, gqa, order)))
    monkeypatch.setattr(sdpa_causal, "_CHECKED", {})
    be = check_rewrite(bool_causal, qkv(), {"sdpa_causal_mask": 1})
    reason = be.log.decisions[-1].reason
    assert "became aten._scaled_dot_product_flash_attention_for_cpu.default (cuDNN first: the new call " \
           "failed on this signature: NotImplementedError" in reason, reason


def test_the_fused_op_computes_its_logsumexp():
    """make_fx traces the new call on inputs that need no grad: a fused op told not to compute its
    logsumexp returns none at run time, which the backward reads and Inductor's output check of the op
    expects (cuDNN's op on the H100, stop 38)."""
    from fusion_compiler.canonical import trace_function
    from fusion_compiler.patterns.sdpa_causal import LSE_FLAG, keep_logsumexp

    def attend(q, k, v):
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, False, is_causal=True)[0]
    q, k, v = qkv(kv=4)
    replacement = trace_function(attend, [q, k, v])
    keep_logsumexp(replacement)
    ops = [n for n in replacement.graph.nodes if n.target in LSE_FLAG]
    assert len(ops) == 1 and ops[0].args[4] is True
    assert "None, True, 0.0, True" in replacement.code
