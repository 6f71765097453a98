"""Train a small HF Mixtral with backend="fusion" on CPU, then show the MoE decision at the reference size.

    TRITON_INTERPRET=1 python examples/train_mixtral.py [--steps 3]

1. A 2-layer Mixtral (random weights, no download, HF's default grouped_mm experts) trains a few steps
   compiled with the fusion backend (every legal region rewritten, hand-off aot_eager so it runs on
   the CPU through Triton's interpreter) next to eager: the losses agree, each layer's experts are
   one fusion::moe_experts call and its router's top-k one fusion::topk call.
2. The decision for the reference MoE block (8 experts, top-2, hidden 2048, ffn 4096, 8192 tokens,
   bf16, training) under the default config, traced on the meta device (no kernel runs): which path
   the cost model picks and its estimate against Inductor.
"""
import argparse
import time

import torch
from transformers import MixtralConfig, MixtralForCausalLM
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

import fusion_compiler as fc


def train(model, forward, ids, steps):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def small_training(steps):
    cfg = MixtralConfig(vocab_size=512, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=256)
    torch.manual_seed(0)
    ref, ours = MixtralForCausalLM(cfg), MixtralForCausalLM(cfg)
    ours.load_state_dict(ref.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 48))
    backend = fc.backend(handoff="aot_eager", cost_model="always")
    t = time.perf_counter()
    losses = train(ours, torch.compile(ours, backend=backend), ids, steps)
    took = time.perf_counter() - t
    ref_losses = train(ref, ref, ids, steps)
    print(f"== 1. small Mixtral, {steps} AdamW steps, every legal region on our kernels ({took:.1f} s)")
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        print(f"   step {i}: loss {a:.6f}   eager {b:.6f}   |diff| {abs(a - b):.1e}")
        assert abs(a - b) < 1e-4 * abs(b), "fusion and eager disagree"
    moe = fc.Report([d for d in backend.log.decisions if d.family == "moe"])
    print(moe)
    assert len(moe.where(pattern="moe_experts", verdict="applied")) == cfg.num_hidden_layers
    assert len(moe.where(pattern="moe_router_topk", verdict="applied")) == cfg.num_hidden_layers


def reference_block():
    cfg = MixtralConfig(hidden_size=2048, intermediate_size=4096, num_local_experts=8, num_experts_per_tok=2)
    cfg._experts_implementation = "grouped_mm"  # what from_pretrained / the model classes set (the default)
    backend = fc.backend(handoff="aot_eager", cost_baseline="inductor", families={"moe"})
    with torch.device("meta"):
        block = MixtralSparseMoeBlock(cfg).to(torch.bfloat16)
        x = torch.randn(1, 8192, 2048, dtype=torch.bfloat16, requires_grad=True)
    torch.compile(block, backend=backend)(x)
    print("\n== 2. the reference MoE block (8 experts, top-2, 2048 / 4096, 8192 tokens, bf16, training), "
          "default config:")
    print(fc.Report(backend.log.decisions))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    small_training(args.steps)
    reference_block()


if __name__ == "__main__":
    main()
