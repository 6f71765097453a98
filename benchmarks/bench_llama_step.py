"""The reference Llama train step (../shared/anchors/README.md): eager vs Inductor vs fusion.

    python benchmarks/bench_llama_step.py [--modes eager inductor fusion fusion_drop_logits fusion_always liger]
                                          [--steps 10] [--profile]

4 layers, hidden 2048, 32 heads / 8 kv, ffn 8192, vocab 128256, bf16, batch 2 x 2048, AdamW(fused).
Reports the first step (compile) time, the median step time, tokens/s, peak memory and the first loss.
fusion_fp8_{rowwise,tensorwise}: FusionConfig(fp8=recipe), the linears the cost model takes in FP8;
fusion_fp8_always: every linear in FP8 (rowwise) and nothing else rewritten; fusion_fp8_norm: the same and
every RMSNorm fused (its kernel casts the next linears' input to FP8); fusion_fp8_norm_nofuse: the same
with FusionConfig(fp8_fuse_cast=False) (each linear casts its input); fusion_fp8_tensorwise_mem: with
prefer_memory=True (the backward casts each weight again, and recomputes cheap linear inputs);
fusion_fp8_tensorwise_drop: with drop_logits=True (HF's returned logits come back empty, so autograd fills
no zero gradient for them and the fused loss reads none); fusion_fp8_tensorwise_mem_drop_cg: both, with CUDA
graphs. MODE_cg: with CUDA graphs
(inductor_cg: torch.compile(mode="reduce-overhead"); fusion modes: FusionConfig(cudagraphs=True)).
fusion_drop_logits: FusionConfig(drop_logits=True, prefer_memory=True), the documented recipe that
lets the LM head and the loss fuse although HF returns the logits, and takes the chunked op for its
memory although it is a little slower than Inductor's (cost.py); fusion_drop_logits@64: the same with
at most 64 MiB of logits per chunk. torchao_fp8: torchao's float8 training (tensorwise; every nn.Linear swapped, LM head included, as its
default converts them) under Inductor; torchao_fp8_cg: the same with CUDA graphs. liger: Liger-Kernel's patched HF Llama, eager (it
patches the model classes for the whole process, so it runs last).
"""
import argparse
import os
import statistics
import time

import torch

from common import bench_gpu_ms, env, kernels_ms, save, table, torchao_float8


def build(seed=0, layers=4):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)


def make_step(mode, batch=2, seq=2048):
    """(step function, fusion backend or None, model, optimizer) of one mode; "MODE@N": the chunked
    LM head + loss holds at most N MiB of logits per chunk (codegen's CHUNK_BYTES, default 256);
    "MODE-FAMILY": a fusion mode with that pattern family disabled."""
    import fusion_compiler as fc
    from fusion_compiler.codegen import linear_cross_entropy
    mode, _, chunk_mib = mode.partition("@")
    mode, _, disabled = mode.partition("-")
    off = {"disable_families": frozenset({disabled})} if disabled else {}
    linear_cross_entropy.CHUNK_BYTES = int(chunk_mib or 256) << 20
    if mode == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama()
    model = build()
    if mode.startswith("torchao_fp8"):
        model = torchao_float8(model, "tensorwise")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    be = {"fusion": fc.backend(**off) if off else "fusion", "fusion_always": fc.backend(cost_model="always", **off),
          "fusion_drop_logits": fc.backend(drop_logits=True, prefer_memory=True, **off), "inductor": "inductor",
          "fusion_fp8_rowwise": fc.backend(fp8="rowwise"), "fusion_fp8_tensorwise": fc.backend(fp8="tensorwise"),
          "fusion_fp8_always": fc.backend(fp8="rowwise", cost_model="always", families={"fp8"}),
          "fusion_fp8_norm": fc.backend(fp8="rowwise", cost_model="always", families={"fp8", "norm"}),
          "fusion_fp8_norm_nofuse": fc.backend(fp8="rowwise", cost_model="always", families={"fp8", "norm"},
                                               fp8_fuse_cast=False),
          "fusion_cg": fc.backend(cudagraphs=True), "fusion_fp8_rowwise_cg": fc.backend(fp8="rowwise", cudagraphs=True),
          "fusion_fp8_tensorwise_cg": fc.backend(fp8="tensorwise", cudagraphs=True),
          "fusion_fp8_tensorwise_drop_cg": fc.backend(fp8="tensorwise", cudagraphs=True, drop_logits=True),
          "fusion_fp8_tensorwise_mem": fc.backend(fp8="tensorwise", prefer_memory=True),
          "fusion_fp8_tensorwise_mem_drop_cg": fc.backend(fp8="tensorwise", prefer_memory=True, drop_logits=True,
                                                          cudagraphs=True),
          "fusion_fp8_norm_cg": fc.backend(fp8="rowwise", cost_model="always", families={"fp8", "norm"},
                                           cudagraphs=True)}.get(mode)
    if be is None and mode not in ("eager", "liger", "inductor_cg", "torchao_fp8", "torchao_fp8_cg"):
        raise ValueError(f"unknown mode {mode!r}")
    if mode.endswith("_cg") and not mode.startswith("fusion"):  # inductor_cg, torchao_fp8_cg
        fwd = torch.compile(model, mode="reduce-overhead")
    elif be is not None or mode == "torchao_fp8":
        fwd = torch.compile(model, backend=be or "inductor")
    else:  # eager, liger
        fwd = model
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, 128256, (batch, seq), device="cuda", generator=g)

    def step():
        loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step, (be if not isinstance(be, str) else None), model, opt


def host_syncs(step) -> list:
    """The CUDA synchronizations one step makes (torch.cuda's sync debug mode warns at each): a sync
    drains the launch queue, so the GPU idles until the host has launched the next kernels."""
    import warnings
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sorted({str(w.message).splitlines()[0][:120] for w in caught if "synchroniz" in str(w.message)})


def run_mode(mode, steps, batch=2, seq=2048, profile=False, sync_check=False, top=25):
    import fusion_compiler as fc
    step, be, model, opt = make_step(mode, batch, seq)
    torch.cuda.synchronize()
    t = time.perf_counter()
    loss0 = step().item()
    first = time.perf_counter() - t
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        step()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    ms = statistics.median(times)
    row = dict(mode=mode, first_step_s=round(first, 1), step_ms=round(ms, 2),
               tokens_per_s=int(batch * seq / ms * 1e3),
               peak_GiB=round(torch.cuda.max_memory_allocated() / 2**30, 2),
               peak_MiB=round(torch.cuda.max_memory_allocated() / 2**20, 1), loss0=round(loss0, 4))
    if sync_check:
        row["host_syncs"] = host_syncs(step)
        print(mode, "host syncs in one step:", row["host_syncs"], flush=True)
    if profile:  # and the step's GPU time: kernels alone, no launch gaps (wall time above that: the host)
        row["gpu_ms"] = round(bench_gpu_ms(step, iters=5), 2)
        row["kernels"] = kernels_ms(step, top=top)
        print(table([dict(kernel=k, ms=t, calls=c) for k, t, c in row["kernels"]], ["kernel", "ms", "calls"]), flush=True)
    if mode.startswith("fusion"):
        rep = fc.last_report() if mode == "fusion" else fc.Report(be.log.decisions)
        s = rep.summary()
        row["applied"] = s["applied"]
        row["rejected"] = s["rejected"]
        print(rep, flush=True)
    del model, opt, step
    torch.compiler.reset()
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", nargs="+",
                    default=["eager", "inductor", "fusion", "fusion_drop_logits", "fusion_always", "liger"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile", action="store_true", help="also list each mode's most expensive kernels")
    ap.add_argument("--top", type=int, default=25, help="how many kernels --profile lists")
    ap.add_argument("--sync-check", action="store_true", help="also list the CUDA synchronizations of one step")
    a = ap.parse_args()
    rows = []
    for mode in a.modes:
        try:
            rows.append(run_mode(mode, a.steps, profile=a.profile, sync_check=a.sync_check, top=a.top))
        except Exception as e:  # noqa: BLE001  (a peer that fails is a row, not the end of the run)
            rows.append(dict(mode=mode, step_ms=f"failed: {type(e).__name__}: {str(e)[:120]}"))
            torch.compiler.reset()
            torch.cuda.empty_cache()
        print(rows[-1], flush=True)
        save(os.environ.get("BENCH_NAME", "llama_step.json"), {"env": env(), "rows": rows})  # a cut run keeps these
    print(env())
    print(table(rows, ["mode", "first_step_s", "step_ms", "gpu_ms", "tokens_per_s", "peak_GiB", "peak_MiB", "loss0", "applied", "rejected"]))


if __name__ == "__main__":
    main()
