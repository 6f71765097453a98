"""The demo: train a small HF Llama with backend="fusion" on CPU, then show the decisions.

    TRITON_INTERPRET=1 python examples/train_llama.py [--steps 3]

1. A 2-layer Llama (random weights, no download) trains a few steps compiled with the fusion backend
   (every legal region rewritten, hand-off aot_eager so it runs on the CPU through Triton's
   interpreter; drop_logits=True so the LM head and the loss become one chunked op; the AdamW step
   compiled too, one multi-tensor launch) next to eager: the losses agree.
2. The decision table for one decoder layer of the reference Llama (hidden 2048, 2 x 2048 tokens,
   bf16) under the default config: what the roofline cost model, calibrated on the H200, decides
   against Inductor's own fusion, region by region, with the reason.
"""
import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

import fusion_compiler as fc


def train(model, forward, ids, steps, compile_step=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = compile_step(opt.step) if compile_step else opt.step
    losses = []
    for _ in range(steps):
        loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def small_training(steps):
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    ref, ours = LlamaForCausalLM(cfg), LlamaForCausalLM(cfg)
    ours.load_state_dict(ref.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 64))
    # drop_logits: HF returns outputs.logits; dropping them lets the LM head and the loss fuse
    backend = fc.backend(handoff="aot_eager", cost_model="always", drop_logits=True)
    t = time.perf_counter()
    losses = train(ours, torch.compile(ours, backend=backend), ids, steps,
                   compile_step=lambda step: torch.compile(step, backend=backend))
    took = time.perf_counter() - t
    ref_losses = train(ref, ref, ids, steps)
    print(f"== 1. small Llama, {steps} AdamW steps (model and optimizer step compiled), every legal region "
          f"on our kernels ({took:.1f} s)")
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        print(f"   step {i}: loss {a:.6f}   eager {b:.6f}   |diff| {abs(a - b):.1e}")
        assert abs(a - b) < 1e-4 * abs(b), "fusion and eager disagree"
    print(fc.Report(backend.log.decisions))


def reference_layer():
    cfg = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=4,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(cfg, layer_idx=0).to(torch.bfloat16)
    rotary = LlamaRotaryEmbedding(cfg)
    h = torch.randn(2, 2048, 2048, dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(2048)[None].expand(2, -1)
    cos, sin = rotary(h, pos)

    def block(h, residual, cos, sin):  # the residual stream, as between two layers of the model
        return layer(h + residual, position_embeddings=(cos, sin))

    report = fc.explain(block, h, torch.randn_like(h), cos, sin)
    print("\n== 2. one reference Llama layer (hidden 2048, 2 x 2048 tokens, bf16, training), default config "
          "(launched op by op: each op call's host time counts; FusionConfig(cudagraphs=True) drops it):")
    print(report)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    small_training(args.steps)
    reference_layer()


if __name__ == "__main__":
    main()
