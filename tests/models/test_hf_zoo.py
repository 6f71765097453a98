"""More HF architectures (small configs, random weights), every legal rewrite forced: one training
step matches eager in loss and every gradient, and the expected regions are rewritten (with
drop_logits: the LM head and the loss become the chunked linear + cross-entropy).

Covers spellings the Llama tests do not: Phi-3's fused gate/up projection + chunk, GPT-NeoX's partial
rotary embedding and LayerNorm, Qwen3's per-head q/k RMSNorm, StarCoder2's LayerNorm with bias,
Gemma's (1 + w) RMSNorm and tanh-GeGLU, each with SDPA and with eager (hand-written) attention.
Gradients that are zero in exact arithmetic (the key projection's bias: softmax ignores a per-query
constant) are compared with an absolute floor.
"""
import pytest
import torch
import transformers as T

import fusion_compiler as fc

SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
# gemm_horizontal: per layer q/k/v and gate/up (Starcoder2: q/k/v; its MLP is c_fc + GELU)
ZOO = {
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, dict(SMALL, head_dim=16),
              {"add_rms_norm": 4, "rms_norm": 5, "rope_rotate_half": 4, "glu_silu": 2, "gemm_horizontal": 4}),
    "phi3": (T.Phi3Config, T.Phi3ForCausalLM, dict(SMALL, pad_token_id=0),
             {"add_rms_norm": 4, "rms_norm": 1, "glu_silu_packed": 2, "rope_rotate_half": 4}),
    "gpt_neox": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM,
                 dict(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
                      max_position_embeddings=64, rotary_pct=0.25, attention_dropout=0.0, hidden_dropout=0.0),
                 # per layer: dense_h_to_4h + GELU; dense_4h_to_h + the parallel residual's add
                 {"layer_norm": 5, "rope_rotate_half": 4, "gemm_epilogue": 4}),
    "starcoder2": (T.Starcoder2Config, T.Starcoder2ForCausalLM, dict(SMALL, residual_dropout=0.0, embedding_dropout=0.0),
                   # per layer: c_fc + tanh-GELU; o_proj and c_proj + their residual adds
                   {"layer_norm": 5, "rope_rotate_half": 4, "gemm_epilogue": 6, "gemm_horizontal": 2}),
    "gemma": (T.GemmaConfig, T.GemmaForCausalLM, dict(SMALL, head_dim=16),
              {"add_rms_norm": 4, "rms_norm": 1, "rope_rotate_half": 4, "glu_gelu_tanh": 2, "gemm_horizontal": 4}),
}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", list(ZOO))
def test_one_training_step_matches_eager(name, attn):
    config_cls, model_cls, kwargs, expect = ZOO[name]
    torch.manual_seed(0)
    ref = model_cls(config_cls(**kwargs, attn_implementation=attn))
    ours = model_cls(config_cls(**kwargs, attn_implementation=attn))
    ours.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 256, (2, 24))
    be = fc.backend(handoff="aot_eager", cost_model="always", drop_logits=True)
    loss = torch.compile(ours, backend=be)(input_ids=ids, labels=ids).loss
    loss.backward()
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    for (n, p), r in zip(ours.named_parameters(), ref.parameters()):
        if r.grad is not None:
            err = (p.grad - r.grad).norm().item()
            assert err <= 1e-3 * r.grad.norm().item() + 1e-7, f"{n}: {err:.2e} vs |grad| {r.grad.norm().item():.2e}"
    applied = {}
    for d in be.log.decisions:
        assert d.verdict == "applied", d
        applied[d.pattern] = applied.get(d.pattern, 0) + 1
    # HF's LM head + causal-LM loss (Gemma's head is tied), the token embedding
    expect = dict(expect, linear_cross_entropy_mean=1, embedding=1)
    if attn == "eager":  # HF's in-graph mask, recognized as causal; repeat_kv'd k/v (GQA models) unrepeated
        expect = dict(expect, attention_causal_mask=2)
        if kwargs.get("num_key_value_heads", kwargs["num_attention_heads"]) < kwargs["num_attention_heads"]:
            expect["sdpa_causal_mask"] = 2
    assert applied == expect
