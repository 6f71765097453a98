import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import fusion_compiler as fc
from tests.helpers import check_rewrite, fusion_ops

N = 341  # not a multiple of any block size


def _w(dtype):
    return (1 + 0.2 * torch.randn(N)).to(dtype)


RMS_SPELLINGS = {
    "hf_llama": lambda x, w: LlamaRMSNorm.forward(_Holder(w, 1e-6), x),
    "torch_nn": lambda x, w: F.rms_norm(x, (N,), w, 1e-5),
    "hand_written": lambda x, w: x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + 1e-6) * w,
    "square_and_sqrt": lambda x, w: w * (x / torch.sqrt(torch.square(x).mean(-1, keepdim=True) + 1e-6)),
    "gemma_one_plus_w": lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w),
}


class _Holder:
    """Stands in for the LlamaRMSNorm module so its real forward runs on a given weight."""

    def __init__(self, weight, eps):
        self.weight, self.variance_epsilon = weight, eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spelling", list(RMS_SPELLINGS))
def test_rms_norm_spellings(spelling, dtype):
    x = torch.randn(3, 7, N).to(dtype)
    be = check_rewrite(RMS_SPELLINGS[spelling], [x, _w(dtype)], {"rms_norm": 1}, dtype)
    assert fusion_ops(be) == ["fusion::rms_norm"]


def test_nn_rmsnorm_module_eps_default():
    m = nn.RMSNorm(N)  # eps=None: finfo(dtype).eps appears as the literal
    be = check_rewrite(lambda x, w: F.rms_norm(x, (N,), w, m.eps), [torch.randn(5, N), _w(torch.float32)],
                       {"rms_norm": 1})
    d = be.log.decisions[0]
    assert d.inputs[-1] == repr(torch.finfo(torch.float32).eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_add_rms_norm(dtype):
    def block(x, r, w):  # HF decoder-layer shape: the sum is the next residual and is returned
        h = r + x
        return LlamaRMSNorm.forward(_Holder(w, 1e-6), h), h

    be = check_rewrite(block, [torch.randn(2, 9, N).to(dtype), torch.randn(2, 9, N).to(dtype), _w(dtype)],
                       {"add_rms_norm": 1}, dtype)
    assert fusion_ops(be) == ["fusion::add_rms_norm"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm(dtype, bias):
    ln = nn.LayerNorm(N, bias=bias).to(dtype)
    args = [torch.randn(4, 5, N).to(dtype), _w(dtype)] + ([(0.1 * torch.randn(N)).to(dtype)] if bias else [])
    fn = (lambda x, w, b: F.layer_norm(x, (N,), w, b, ln.eps)) if bias else \
        (lambda x, w: F.layer_norm(x, (N,), w, None, ln.eps))
    check_rewrite(fn, args, {"layer_norm" if bias else "layer_norm_no_bias": 1}, dtype)


# --- near misses ---------------------------------------------------------------------------------------
def _decisions(fn, *args, **config):
    be = fc.FusionBackend(fc.FusionConfig(handoff="aot_eager", cost_model="always", **config))
    out = torch.compile(fn, backend=be)(*args)
    return be, out


def test_intermediate_used_elsewhere_is_a_near_miss():
    def fn(x, w):
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + 1e-6) * w, var  # the variance escapes the region
    x, w = torch.randn(4, N), _w(torch.float32)
    be, out = _decisions(fn, x, w)
    [d] = be.log.decisions
    assert d.verdict == "near-miss" and "also used by" in d.reason
    assert fusion_ops(be) == []
    torch.testing.assert_close(out[0], fn(x, w)[0])


def test_float64_is_rejected_with_reason():
    be, _ = _decisions(RMS_SPELLINGS["hand_written"], torch.randn(4, N, dtype=torch.float64),
                       _w(torch.float64))
    [d] = be.log.decisions
    assert d.verdict == "rejected" and "float64" in d.reason


def test_weight_that_broadcasts_rows_is_rejected():
    be, _ = _decisions(RMS_SPELLINGS["hand_written"], torch.randn(4, N), torch.randn(4, N))
    [d] = be.log.decisions
    assert d.verdict == "rejected" and "weight of shape" in d.reason


def test_mean_over_another_dim_does_not_match():
    fn = lambda x, w: x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-6) * w  # noqa: E731
    be, _ = _decisions(fn, torch.randn(4, N), _w(torch.float32))
    assert be.log.decisions == []


def test_cpu_without_interpreter_is_rejected(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    be, out = _decisions(RMS_SPELLINGS["hand_written"], torch.randn(4, N), _w(torch.float32))
    [d] = be.log.decisions
    assert d.verdict == "rejected" and "need CUDA" in d.reason


def test_mixed_devices_are_rejected():
    from fusion_compiler.matcher import Match
    from fusion_compiler.patterns.checks import kernel_inputs

    match = Match(None, None, [], [], [])
    match.input_values = lambda: [torch.empty(4, 8), torch.empty(8, device="meta")]
    assert "several devices" in kernel_inputs(match)


def test_region_whose_layout_the_op_would_change_is_rejected():
    """x laid out column-major: eager's result follows x's strides, our op writes rows; the graph
    downstream was traced against the original layout, so the region stays as it is."""
    x, w = torch.randn(N, 6).t(), _w(torch.float32)
    be, out = _decisions(RMS_SPELLINGS["hand_written"], x, w)
    [d] = be.log.decisions
    assert d.verdict == "rejected" and "strides" in d.reason
    torch.testing.assert_close(out, RMS_SPELLINGS["hand_written"](x, w))


def test_weight_computed_after_the_residual_sum():
    """Gemma's (1 + w) is computed after h = x + r: the fused op goes after it, and h's own uses
    inside the region (before that point) must not be redirected to it."""
    def block(x, r, w):
        h = x + r
        normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return normed * (1.0 + w), h  # the weight term last, as Gemma2RMSNorm does
    check_rewrite(block, [torch.randn(3, N), torch.randn(3, N), 0.1 * torch.randn(N)], {"add_rms_norm": 1})


def test_add_rms_norm_near_misses():
    def block(x, r, w):
        h = x + r
        var = h.pow(2).mean(-1, keepdim=True)
        return h * torch.rsqrt(var + 1e-6) * w, h, var  # the variance escapes
    be, _ = _decisions(block, torch.randn(3, N), torch.randn(3, N), _w(torch.float32))
    assert [d.verdict for d in be.log.decisions if d.pattern == "add_rms_norm"] == ["near-miss"]
    assert fusion_ops(be) == []

    def mixed(x, r, w):  # bf16 activations plus an fp32 residual: h would be written in which dtype?
        h = x + r
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w, h
    be, _ = _decisions(mixed, torch.randn(3, N).bfloat16(), torch.randn(3, N), _w(torch.float32))
    [d] = [d for d in be.log.decisions if d.pattern == "add_rms_norm"]
    assert d.verdict == "rejected" and "residual" in d.reason


def test_layer_norm_over_two_dims_does_not_match():
    fn = lambda x, w, b: F.layer_norm(x, (6, N), w, b)  # noqa: E731
    be, out = _decisions(fn, torch.randn(2, 6, N), torch.randn(6, N), torch.randn(6, N))
    assert all(d.verdict != "applied" for d in be.log.decisions) and fusion_ops(be) == []
