"""HF MoE models from small configs (random weights, no hub): Mixtral (with its router aux loss) and
Qwen2-MoE (shared expert with a sigmoid gate beside the routed ones) train 3 steps under the fusion
backend matching eager, with the routed experts of every layer one fusion::moe_experts call; and
Mixtral with transformers 4.x's per-expert ModuleList loop as every layer's MoE block, through
fusion_compiler.compile.

fp32; tolerances as tests/models/test_hf_models.py (loss 1e-5, every gradient 1e-3).
"""
import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

import fusion_compiler as fc
from tests.models.test_hf_models import train_both_and_compare

LAYERS = 2
SMALL = dict(vocab_size=256, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64)
MODELS = {
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(**SMALL, intermediate_size=48, num_local_experts=4,
                                                        num_experts_per_tok=2, output_router_logits=True,
                                                        router_aux_loss_coef=0.02)),
    "qwen2_moe": lambda: Qwen2MoeForCausalLM(Qwen2MoeConfig(**SMALL, intermediate_size=96, moe_intermediate_size=32,
                                                            shared_expert_intermediate_size=48, num_experts=6,
                                                            num_experts_per_tok=3, norm_topk_prob=False,
                                                            decoder_sparse_step=1, mlp_only_layers=[])),
}


@pytest.mark.parametrize("moe_impl", ["triton", "grouped_mm"])
@pytest.mark.parametrize("name", list(MODELS))
def test_trains_with_every_layers_experts_fused(name, moe_impl):
    be = fc.backend(handoff="aot_eager", cost_model="always", moe_impl=moe_impl)
    train_both_and_compare(MODELS[name], be)
    rows = [d for d in be.log.decisions if d.pattern == "moe_experts"]
    assert [d.verdict for d in rows] == ["applied"] * LAYERS, rows
    assert all(f"impl {moe_impl}" in d.reason for d in rows)
    # every top-k: each layer's router's and (Mixtral) the aux loss's over all layers' router logits
    routers = [d for d in be.log.decisions if d.pattern == "moe_router_topk"]
    assert len(routers) >= LAYERS and all(d.verdict == "applied" for d in routers), routers


def _mixtral_with_4x_loops():
    """HF Mixtral whose MoE blocks are transformers 4.x's (tests/patterns/test_moe_patterns.py's copy)."""
    from tests.patterns.test_moe_patterns import LoopMoE4x
    model = MixtralForCausalLM(MixtralConfig(**SMALL, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2))
    for layer in model.model.layers:
        layer.mlp = LoopMoE4x(experts=4, top_k=2, hidden=SMALL["hidden_size"], ffn=48)
    return model


def test_transformers_4x_loops_train_through_fusion_compile():
    be = fc.backend(handoff="aot_eager", cost_model="always")
    train_both_and_compare(_mixtral_with_4x_loops, be, compiler=fc.compile)
    rows = [d for d in be.log.decisions if d.pattern == "moe_experts"]
    assert [d.verdict for d in rows] == ["applied"] * LAYERS and all("per-expert loop" in d.reason for d in rows)
