"""Exposed communication before and after the overlap pass, estimated on the scheduled graphs.

    python benchmarks/simulate_overlap.py [--ranks 2 4 8] [--tokens 4096] [--budgets 0.1 0.0]

One decoder layer of the reference Llama (hidden 2048, 32 heads / 8 kv, ffn 8192, bf16, 2 x 2048
tokens), fwd+bwd, compiled with backend="fusion" on the CPU inside a fake process group of N ranks
(torch's "fake" backend: collectives return at once, shapes are real), in two layouts:
  tp    DTensor tensor parallel: q/k/v and gate/up colwise, o and down rowwise (all-reduces)
  fsdp  SimpleFSDP-style: every weight stored as a 1/N shard and all-gathered where it is used
        (all_gather_tensor_autograd: its backward is a reduce-scatter of the gradient)
The pass's cost model (H100 + NVLink figures: comm_cost.H100_NVLINK) prices each collective and the
compute scheduled between its issue and its wait; exposed = max(0, comm - overlapped compute).
fsdp is also run under memory budgets (`overlap_memory_budget`): the original order's estimated
peak live bytes plus 10%, and that peak itself, since unbounded the pass gathers every weight of
the layer at the start.
Nothing here is timed: it is the estimate the pass decides with.
"""
import argparse
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.testing._internal.distributed.fake_pg import FakeStore

import fusion_compiler as fc
from common import save, table


def _layer():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    cfg = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=1,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaDecoderLayer(cfg, layer_idx=0).to(torch.bfloat16), LlamaRotaryEmbedding(cfg)


class _AllGather(nn.Module):
    """A parametrization: the stored shard, all-gathered along dim 0 when the weight is read."""

    def forward(self, shard):
        return funcol.all_gather_tensor_autograd(shard, 0, dist.group.WORLD)


def _shard(layer, ranks):
    from torch.nn.utils import parametrize
    for mod in layer.modules():
        if isinstance(mod, nn.Linear):
            rows = mod.weight.shape[0] // ranks
            mod.weight = nn.Parameter(mod.weight.detach()[:rows].clone())
            parametrize.register_parametrization(mod, "weight", _AllGather(), unsafe=True)
    return layer


def _tensor_parallel(layer, ranks):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (ranks,))
    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    return parallelize_module(layer, mesh, plan)


def simulate(layout, ranks, tokens, budget=None):
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
    try:
        layer, rotary = _layer()
        layer = _tensor_parallel(layer, ranks) if layout == "tp" else _shard(layer, ranks)
        h = torch.randn(2, tokens // 2, 2048, dtype=torch.bfloat16, requires_grad=True)
        cos, sin = rotary(h, torch.arange(tokens // 2)[None].expand(2, -1))
        be = fc.backend(overlap_memory_budget=budget)
        t = time.perf_counter()
        out = torch.compile(layer, backend=be, dynamic=False)(h, position_embeddings=(cos, sin))
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()
        took = time.perf_counter() - t
        est = be.overlap.estimates if be.overlap else []
        comm = sum(e[1] for e in est)
        before, after = sum(e[2] for e in est), sum(e[3] for e in est)
        kinds = sorted({e[0] for e in est})
        peaks = be.overlap.peaks if be.overlap else [(0, 0)]
        return dict(layout=layout + (f" (budget {budget / 2**20:.0f} MiB)" if budget else ""), ranks=ranks, collectives=len(est),
                    kinds=",".join(kinds),
                    peak_before_mib=round(max(p[0] for p in peaks) / 2**20), peak_after_mib=round(max(p[1] for p in peaks) / 2**20),
                    comm_us=round(comm * 1e6, 1), exposed_before_us=round(before * 1e6, 1),
                    exposed_after_us=round(after * 1e6, 1),
                    reduction=f"{(1 - after / before) * 100:.0f}%" if before else "-", compile_run_s=round(took, 1))
    finally:
        torch.compiler.reset()
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--layouts", nargs="+", default=["tp", "fsdp"])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--budgets", type=float, nargs="*", default=[0.1, 0.0],
                    help="fsdp also under memory budgets: the original order's peak x (1 + each)")
    a = ap.parse_args()
    rows = []
    for layout in a.layouts:
        for ranks in a.ranks:
            rows.append(simulate(layout, ranks, a.tokens))
            print(rows[-1], flush=True)
            peak = rows[-1]["peak_before_mib"] * 2**20
            for share in a.budgets if layout == "fsdp" else ():  # the original order's peak + a share
                rows.append(simulate(layout, ranks, a.tokens, peak * (1 + share)))
                print(rows[-1], flush=True)
    save("overlap_simulation.json", {"rows": rows, "link": "h100-nvlink 450 GB/s, 737 TFLOP/s, 3.0 TB/s"})
    print(table(rows, ["layout", "ranks", "collectives", "kinds", "comm_us", "exposed_before_us",
                       "exposed_after_us", "reduction", "peak_before_mib", "peak_after_mib", "compile_run_s"]))


if __name__ == "__main__":
    main()
