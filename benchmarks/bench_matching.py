"""Cost of canonicalize + match + decide on a 32-layer Llama graph (CPU), against the same graph's
Inductor compile time (cold cache, forward and backward).

    TRITON_INTERPRET=1 python benchmarks/bench_matching.py [--layers 32]
Kernel verification (one run of each new kernel signature) is switched off here: it is a one-time
compile-and-run cost per signature, like Inductor's own autotuning, not part of matching.
"""
import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench-matching-")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import fusion_compiler as fc  # noqa: E402
from fusion_compiler import _compat, engine  # noqa: E402
from fusion_compiler.canonical import to_aten  # noqa: E402
from fusion_compiler.decisions import DecisionLog  # noqa: E402

from common import env, save  # noqa: E402


def capture(model, ids):
    graphs = []

    def grab(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch.compile(model, backend=grab)(input_ids=ids, labels=ids)
    return graphs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    a = ap.parse_args()
    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=a.layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 128))
    [(gm, inputs)] = capture(model, ids)
    nodes = len(gm.graph.nodes)
    config = fc.FusionConfig(verify_kernels=False)
    grad_inputs = [isinstance(t, torch.Tensor) and t.requires_grad for t in inputs]
    times, canon = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        aten_gm, _ = to_aten(gm, inputs)
        t1 = time.perf_counter()
        log = DecisionLog()
        engine.run(aten_gm, config, log, 0, grad_inputs)
        t2 = time.perf_counter()
        canon.append(t1 - t0)
        times.append(t2 - t0)
    ours = statistics.median(times)
    t0 = time.perf_counter()
    compiled = _compat.compile_fx(gm, inputs)
    out = compiled(*inputs)
    next(o for o in out if o.dim() == 0).backward()  # the loss
    inductor = time.perf_counter() - t0
    row = dict(layers=a.layers, dynamo_nodes=nodes, aten_nodes=len(aten_gm.graph.nodes),
               candidates=len(log.decisions), canonicalize_s=round(statistics.median(canon), 3),
               canonicalize_match_decide_s=round(ours, 3), inductor_compile_fwd_bwd_s=round(inductor, 1),
               ratio_percent=round(100 * ours / inductor, 2))
    save("matching.json", {"env": env(), "row": row})
    print(env())
    print(row)


if __name__ == "__main__":
    main()
