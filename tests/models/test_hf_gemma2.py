"""HF Gemma 2 (small config, eager attention): logit soft-capping, (1 + w) RMSNorms, tanh-GeGLU.

Inference: every region is rewritten (soft-capped attention as FlexAttention with the causal or the
sliding-window block mask) and the logits match eager. Training on the CPU: FlexAttention has no CPU backward, so the one-time kernel check keeps the
attention on eager with that reason, the rest is rewritten, and 3 steps match eager.
"""
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM

import fusion_compiler as fc
from tests.helpers import rel_err
from tests.models.test_hf_models import train_both_and_compare

LAYERS = 2


def _model():
    torch.manual_seed(0)
    return Gemma2ForCausalLM(Gemma2Config(
        vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, attn_implementation="eager",
        sliding_window=8))


def test_gemma2_inference_rewrites_every_region():
    model = _model()
    ids = torch.randint(0, 256, (2, 24))
    be = fc.backend(handoff="aot_eager", cost_model="always")
    with torch.no_grad():
        out = torch.compile(model, backend=be)(input_ids=ids).logits
        ref = model(input_ids=ids).logits
    assert rel_err(out, ref) < 1e-5
    applied = {}
    for d in be.log.decisions:
        if d.verdict == "applied":
            applied[d.pattern] = applied.get(d.pattern, 0) + 1
        else:  # the sliding-window layer's mask, built from constants, is not causal
            assert d.pattern == "attention_softcap_causal_mask" and d.reason == "constant mask is not causal", d
    # full layers: the causal block mask; sliding-window layers: the block mask reduced from the window
    assert applied == {"attention_softcap_causal_mask": LAYERS // 2, "attention_softcap_block_mask": LAYERS // 2, "add_rms_norm": 2 * LAYERS, "rms_norm": 2 * LAYERS + 1,
                       "rope_rotate_half": 2 * LAYERS, "glu_gelu_tanh": LAYERS, "embedding": 1,
                       "gemm_epilogue": 1,  # the LM head's final logit soft-cap: tanh(logits / c) * c
                       "gemm_horizontal": 2 * LAYERS}  # q/k/v and gate/up


def test_gemma2_trains_with_the_attention_left_to_eager_on_cpu():
    be = fc.backend(handoff="aot_eager", cost_model="always")
    train_both_and_compare(_model, be)
    attention = [d for d in be.log.decisions if d.family == "attention"]
    assert all(d.verdict == "rejected" for d in attention)
    assert {d.location for d in attention if "backward on CPU" in d.reason} == {d.location for d in attention}
    assert len([d for d in attention if "backward on CPU" in d.reason]) >= LAYERS
    # + loss, embedding, the LM head's soft-cap tanh(logits / c) * c as a GEMM epilogue, and per layer
    # q/k/v and gate/up as horizontal GEMMs
    assert len([d for d in be.log.decisions if d.verdict == "applied"]) == 5 * LAYERS + 1 + 4 * LAYERS + 3
    assert sorted(d.pattern for d in be.log.decisions if d.family == "gemm") == \
        ["gemm_epilogue"] + ["gemm_horizontal"] * (2 * LAYERS)
