"""HF Llama with attn_implementation="eager" and HF GPT-2 (small configs, random weights): 3 training
steps under the fusion backend match eager, and every layer's hand-written attention became SDPA.

Dropout is off (attention, residual, embedding): with it on, eager and SDPA draw different random
masks and no two runs could be compared. Tolerances as in test_hf_models.py.
"""
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import fusion_compiler as fc
from tests.models.test_hf_models import train_both_and_compare

LAYERS = 2
MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")),
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(
        vocab_size=256, n_embd=64, n_layer=LAYERS, n_head=4, n_positions=64, attn_pdrop=0.0, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_implementation="eager")),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_eager_attention_trains_as_sdpa(name):
    be = fc.backend(handoff="aot_eager", families={"attention"})
    train_both_and_compare(MODELS[name], be)
    applied = [d for d in be.log.decisions if d.verdict == "applied"]
    # HF builds the causal mask in the graph from constants: recognized as causal, so SDPA gets
    # is_causal (the flash kernel on a GPU) instead of reading the mask; Llama's repeat_kv'd keys and
    # values then go in unrepeated (enable_gqa: patterns/sdpa_causal.py)
    patterns = [d.pattern for d in applied]
    assert patterns.count("attention_causal_mask") == LAYERS, fc.Report(be.log.decisions)
    assert patterns.count("sdpa_causal_mask") == (LAYERS if name == "llama" else 0), fc.Report(be.log.decisions)
    assert all(d.location.startswith(f"modeling_{name}.py:") for d in applied)


@pytest.mark.parametrize("name", list(MODELS))
def test_explain_shows_every_layers_attention(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    ids = torch.randint(0, 256, (2, 24))
    report = fc.explain(model, input_ids=ids, labels=ids)
    applied = report.where(family="attention", verdict="applied")
    assert [d.pattern for d in applied].count("attention_causal_mask") == LAYERS, report


def test_gpt2_training_attention_dropout_is_matched():
    """GPT-2's default attn_pdrop=0.1 in training: the dropout on the probabilities goes into SDPA."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=64, n_layer=LAYERS, n_head=4, n_positions=64,
                                       attn_implementation="eager"))
    ids = torch.randint(0, 256, (2, 24))
    report = fc.explain(model, input_ids=ids, labels=ids)
    applied = report.where(family="attention", verdict="applied")
    assert [d.pattern for d in applied] == ["attention_causal_mask_dropout"] * LAYERS, report
    assert all(d.inputs[-1] == "0.9" for d in applied)


def test_padding_mask_keeps_the_mask():
    """With a padding attention_mask the mask depends on a graph input: it cannot be known at compile
    time, so the causal and block-mask variants are rejected with that reason and SDPA reads the mask; logits match."""
    torch.manual_seed(0)
    model = MODELS["llama"]()
    ids = torch.randint(0, 256, (2, 24))
    pad = torch.ones(2, 24, dtype=torch.long)
    pad[0, :5] = 0
    be = fc.backend(handoff="aot_eager", families={"attention"})
    out = torch.compile(model, backend=be)(input_ids=ids, attention_mask=pad).logits
    ref = model(input_ids=ids, attention_mask=pad).logits
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5
    verdicts = [(d.pattern, d.verdict) for d in be.log.decisions]
    assert verdicts == ([("attention_causal_mask", "rejected")] * LAYERS + [("attention_block_mask", "rejected")] * LAYERS
                        + [("attention_additive_mask", "applied")] * LAYERS + [("sdpa_causal_mask", "rejected")] * LAYERS)
    assert all("computed from graph inputs" in d.reason for d in be.log.decisions if d.verdict == "rejected")
