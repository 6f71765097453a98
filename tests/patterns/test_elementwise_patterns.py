import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import fusion_compiler as fc
from tests.helpers import check_rewrite, fusion_ops


def _trig(*shape, dtype):
    theta = torch.randn(*shape)
    return theta.cos().to(dtype), theta.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_hf_rotate_half_on_q_and_k(dtype):
    b, s, d = 2, 11, 24
    q = torch.randn(b, s, 4, d).transpose(1, 2).to(dtype)  # strided (B, H, S, D) like HF
    k = torch.randn(b, s, 2, d).transpose(1, 2).to(dtype)
    cos, sin = _trig(b, s, d, dtype=dtype)
    be = check_rewrite(lambda q, k, c, s_: apply_rotary_pos_emb(q, k, c, s_), [q, k, cos, sin],
                       {"rope_rotate_half": 2}, dtype)
    assert fusion_ops(be) == ["fusion::rope", "fusion::rope"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_complex_interleaved(dtype):
    """Meta Llama / torchtitan: x (B, S, H, D) times complex freqs_cis reshaped for broadcast."""
    b, s, h, d = 2, 9, 3, 16
    x = torch.randn(b, s, h, d).to(dtype)
    freqs = torch.polar(torch.ones(s, d // 2), torch.randn(s, d // 2))

    def apply(x, freqs):
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        f = freqs.view(1, x.shape[1], 1, x.shape[-1] // 2)
        return torch.view_as_real(xc * f).flatten(3).type_as(x)

    be = check_rewrite(apply, [x, freqs], {"rope_complex": 1}, dtype)
    assert fusion_ops(be) == ["fusion::rope"]


def test_rope_split_off_centre_is_a_near_miss():
    """Same structure as rotate_half, but split 3/5: the exact re-trace at real shapes refuses it."""
    def fn(x, cos, sin):
        return x * cos + torch.cat((-x[..., 3:], x[..., :3]), -1) * sin
    be = fc.FusionBackend(fc.FusionConfig(handoff="aot_eager", cost_model="always"))
    x, (cos, sin) = torch.randn(2, 3, 5, 8), _trig(1, 1, 5, 8, dtype=torch.float32)
    out = torch.compile(fn, backend=be)(x, cos, sin)
    [d] = be.log.decisions
    assert d.verdict == "near-miss" and "differ" in d.reason
    torch.testing.assert_close(out, fn(x, cos, sin))


ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", list(ACTS))
def test_glu_separate_projections(act, dtype):
    g, u = torch.randn(3, 5, 77).to(dtype), torch.randn(3, 5, 77).to(dtype)
    check_rewrite(lambda g, u: ACTS[act](g) * u, [g, u], {f"glu_{act}": 1}, dtype)


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("gate_first", [True, False])
def test_glu_fused_projection_then_chunk(act, gate_first):
    w = torch.randn(2 * 45, 32) / 6

    def mlp(x, w):
        a, b = F.linear(x, w).chunk(2, dim=-1)
        return ACTS[act](a) * b if gate_first else a * ACTS[act](b)

    name = f"glu_{act}_packed" + ("" if gate_first else "_up_first")
    be = check_rewrite(mlp, [torch.randn(3, 7, 32), w], {name: 1})
    assert fusion_ops(be) == ["fusion::glu_packed"]


def test_hand_written_silu_is_canonicalized():
    check_rewrite(lambda g, u: g * torch.sigmoid(g) * u, [torch.randn(4, 50), torch.randn(4, 50)], {"glu_silu": 1})


def test_glu_activation_used_elsewhere_is_a_near_miss():
    be = fc.FusionBackend(fc.FusionConfig(handoff="aot_eager", cost_model="always"))

    def fn(g, u):
        a = F.silu(g)
        return a * u, a.sum()  # the activation escapes the region

    torch.compile(fn, backend=be)(torch.randn(4, 50), torch.randn(4, 50))
    assert [d.verdict for d in be.log.decisions] == ["near-miss"]


def test_glu_with_broadcast_up_is_rejected():
    be = fc.FusionBackend(fc.FusionConfig(handoff="aot_eager", cost_model="always"))
    torch.compile(lambda g, u: F.silu(g) * u, backend=be)(torch.randn(4, 50), torch.randn(50))
    [d] = be.log.decisions
    assert d.verdict == "rejected" and "differ in shape" in d.reason


def test_rope_complex128_freqs_are_rejected():
    def apply(x, freqs):
        xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs.view(1, x.shape[1], 1, -1)).flatten(3).type_as(x)
    be = fc.FusionBackend(fc.FusionConfig(handoff="aot_eager", cost_model="always"))
    x, freqs = torch.randn(2, 9, 3, 16), torch.polar(torch.ones(9, 8, dtype=torch.float64), torch.randn(9, 8, dtype=torch.float64))
    out = torch.compile(apply, backend=be)(x, freqs)
    torch.testing.assert_close(out, apply(x, freqs))
    [d] = be.log.decisions
    assert d.pattern == "rope_complex" and d.verdict == "rejected" and "complex128" in d.reason
    assert fusion_ops(be) == []


def test_packed_glu_activation_used_elsewhere_is_a_near_miss():
    def fn(x):
        a, b = x.chunk(2, dim=-1)
        act = F.silu(a)
        return act * b, act.sum()
    be = fc.FusionBackend(fc.FusionConfig(handoff="aot_eager", cost_model="always"))
    torch.compile(fn, backend=be)(torch.randn(4, 64))
    assert "applied" not in [d.verdict for d in be.log.decisions]
    assert "near-miss" in [d.verdict for d in be.log.decisions]
