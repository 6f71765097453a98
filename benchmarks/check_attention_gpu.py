"""The attention rewrite on the GPU against eager: the reference Llama's dimensions (bench_llama_step.build)
with --layers layers (default 1), bf16, one forward and backward under Inductor and under fusion with the
attention family only; each one's relative
error against eager bf16 in the loss, the logits and every gradient (the largest), and what the
attention decisions say (which SDPA op each call became).

    python benchmarks/check_attention_gpu.py [--layers 1]
"""
import argparse

import torch

import fusion_compiler as fc
from bench_llama_step import build
from common import env, table


def run(compiled, ids):
    model = compiled()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach().float(), out.logits.detach().float(), [p.grad.float() for p in model.parameters()]


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=1)
    layers = ap.parse_args().layers
    ids = torch.randint(0, 128256, (2, 2048), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    eager_model = build(layers=layers)
    ref = run(lambda: eager_model, ids)
    rows = []
    be = fc.backend(families={"attention"})
    for name, backend in (("inductor", "inductor"), ("fusion, attention only", be)):
        model = build(layers=layers)
        loss, logits, grads = run(lambda: torch.compile(model, backend=backend), ids)
        rows.append(dict(mode=name, loss=round(loss.item(), 4), loss_rel=f"{rel(loss, ref[0]):.1e}",
                         logits_rel=f"{rel(logits, ref[1]):.1e}",
                         worst_grad_rel=f"{max(rel(g, r) for g, r in zip(grads, ref[2])):.1e}"))
        del model
        torch.compiler.reset()
    print(env())
    print(f"eager loss {ref[0].item():.4f}")
    print(table(rows, ["mode", "loss", "loss_rel", "logits_rel", "worst_grad_rel"]))
    for d in be.log.decisions:
        print(d.verdict, d.pattern, d.reason[:300])


if __name__ == "__main__":
    main()
