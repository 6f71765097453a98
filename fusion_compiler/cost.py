"""Roofline cost model for memory-bound fused regions.

A fused kernel moves each region input once and each output once; eager moves every intermediate
(each op reads its inputs and writes its output); Inductor fuses elementwise work and reductions too,
so against Inductor the bytes tie and what decides is how close each kernel gets to the copy
bandwidth, measured per kernel and row width on the GPU (benchmarks/RESULTS.md) and stored in
DeviceProfile.efficiency. Time = launches * launch_s + bytes / (bandwidth * efficiency).

Training adds the backward: the fused backward reads the output gradients and the saved inputs and
writes the input gradients; eager's backward of a chain of n ops costs about twice its forward.
"""
import dataclasses
from typing import Optional

import torch
import torch.fx as fx

from . import recompute
from .canonical import val

MARGIN = 0.02  # a rewrite must be estimated at least this much faster than its baseline
# a decision from two timings made at compile time: how far they read from the same kernels timed in
# the benchmark (stop 24, H100, 13 GEMM epilogues: Inductor's region 2-8% high, ours 0-4%)
TIMED_MARGIN = 0.05


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    name: str
    bandwidth: float  # bytes/s, measured device copy (read + write)
    launch_s: float  # per kernel launch
    # kernel -> ((max row width, ours fwd, Inductor fwd, ours fwd+bwd, Inductor fwd+bwd), ...) ascending
    # by width: achieved bytes/s over `bandwidth` (benchmarks/calibrate.py makes these rows)
    efficiency: dict
    eager_efficiency: float = 0.7
    default_efficiency: float = 0.75  # for kernels without measurements: ours and Inductor's alike
    matmul_flops: float = 737e12  # bf16 dense, measured
    # attention kernel -> ((max key length, fraction of matmul_flops on the score tiles computed), ...)
    attention: dict = dataclasses.field(default_factory=dict)
    # ((max vocabulary, our time over Inductor's), ...) for the chunked linear + cross-entropy
    linear_cross_entropy: tuple = ()
    # achieved bandwidth / `bandwidth` of multi-tensor updates: (ours, Inductor on foreach ops,
    # Inductor on per-tensor (for-loop) ops)
    multi_tensor: tuple = ()
    # the same for a global-norm clip's sum-of-squares pass over the gradients: (ours, Inductor's)
    clip_norm: tuple = ()
    # fraction of matmul_flops reached on a large GEMM: (our generated kernel, cuBLAS); and our
    # GEMM + epilogue backward's time over Inductor's (the derivative pass, the side partials)
    gemm: tuple = (0.75, 0.9)
    gemm_backward: float = 1.0
    sms: int = 132  # streaming multiprocessors (H100 SXM, H200): the GEMM tile waves
    # horizontal GEMM fusion timed on the Llama reference layer: (fwd, fwd+bwd) time with q/k/v and
    # gate/up concatenated over the separate GEMMs'; () when not timed on this card
    horizontal: tuple = ()
    # FP8 GEMM rate (torch._scaled_mm, large products), FLOP/s; 0 until measured on the card; and the
    # time an FP8 GEMM costs beyond its GEMM and quantization passes (launches, dispatch), seconds
    fp8_flops: float = 0.0
    fp8_overhead_s: float = 0.0
    # routed experts: (fraction of matmul_flops our Triton grouped GEMMs reach, the same for torch's
    # grouped_mm, the spelling's passes under Inductor over their byte estimate at the copy rate);
    # () until measured on the card (then a rewrite is never estimated faster)
    moe: tuple = ()
    # host time of one call of a project op (Python dispatch, wrapper, Triton launch) beyond what
    # Inductor's launch of its own kernel costs; not paid where the step is replayed as CUDA graphs
    op_host_s: float = 0.0
    # top-k over rows of E (an MoE router's): seconds per row (torch.topk's base, its per element of E,
    # fusion::topk's base, its per element of E x k); () until measured on the card (then not taken)
    topk: tuple = ()


# H200, fwd+bwd, B*H = 64 (B4 H16) up to 2048 and 16 at 8192, D128, bf16: benchmarks/runs/
# 2026-12-03-h200-attention-1.json. FLOPs counted on the score tiles each kernel computes (half for
# flash causal; the block mask's tiles for FlexAttention). "unfused": Inductor's time on the
# hand-written spelling over this module's roofline estimate of it (L2 catches the small scores).
_ATTENTION_H200 = {
    "flash": ((512, 0.42), (2048, 0.69), (1 << 30, 0.76)),
    "flash_causal": ((512, 0.21), (2048, 0.52), (1 << 30, 0.66)),
    "sdpa_mask": ((512, 0.27), (2048, 0.38), (1 << 30, 0.39)),  # efficient kernel reading the mask
    "flex": ((512, 0.20), (2048, 0.385), (1 << 30, 0.45)),  # block mask only
    "flex_score_mod": ((512, 0.08), (2048, 0.19), (1 << 30, 0.21)),  # soft-cap score_mod
    "unfused": ((512, 0.62), (2048, 0.86), (1 << 30, 0.84)),
}


# Until a kernel is measured on a card, ours and Inductor's are assumed equal, so the roofline keeps
# the region on Inductor ("do no harm"); measured rows replace the assumption.
# H200: benchmarks/runs/2026-12-03-h200-norm-elementwise-2.json (32768 tokens, bf16, GPU kernel time).
_H200 = {  # "ours" = our op inside Inductor's graph (the fusion(backend) rows)
    "rms_norm": ((2048, 0.931, 0.774, 0.893, 0.766), (4096, 0.946, 0.83, 0.92, 0.763),
                 (8192, 0.959, 0.996, 0.898, 0.762)),
    "add_rms_norm": ((2048, 0.947, 0.894, 0.922, 0.847), (4096, 0.948, 0.925, 0.939, 0.853),
                     (8192, 0.95, 0.942, 0.93, 0.837)),
    "layer_norm": ((2048, 0.896, 0.569, 0.728, 0.593), (4096, 0.914, 0.631, 0.835, 0.627),
                   (8192, 0.965, 0.828, 0.888, 0.661)),
    "rope": ((1 << 30, 0.832, 0.925, 0.367, 0.381),),
    "glu": ((2048, 0.982, 1.016, 0.973, 1.004), (4096, 0.978, 1.021, 0.971, 1.011),
            (8192, 0.979, 1.024, 0.971, 1.011)),
    "glu_packed": ((2048, 0.979, 1.024, 0.972, 0.697), (4096, 0.983, 1.02, 0.973, 0.708),
                   (8192, 0.98, 1.026, 0.971, 0.708)),
    # width = vocabulary; 4096 rows, bf16, fwd+bwd (runs/2026-12-03-h200-loss-3.json); the forward
    # alone was not timed: the fwd+bwd figures stand for it
    "cross_entropy": ((32000, 0.53, 0.50, 0.53, 0.50), (128256, 0.49, 0.53, 0.49, 0.53),
                      (1 << 30, 0.50, 0.57, 0.50, 0.57)),
}
# H100 (stops 24 and 25, bench_norm_elementwise.py, 32768 rows, bf16; calibrate.py at 3.0 TB/s:
# runs/2026-12-05-h100-norm-elementwise-*.json); the kernels not timed there fall back to the default
_H100 = {
    "rms_norm": ((2048, 0.967, 0.955, 0.925, 0.872), (4096, 0.979, 0.978, 0.957, 0.896),
                 (8192, 0.983, 1.008, 0.949, 0.867)),
    "add_rms_norm": ((2048, 0.98, 0.937, 0.962, 0.909), (4096, 0.981, 0.98, 0.981, 0.932),
                     (8192, 0.985, 0.978, 0.983, 0.922)),
    "glu": ((2048, 0.989, 1.013, 0.981, 1.008), (4096, 0.971, 1.017, 0.969, 1.011),
            (8192, 0.977, 1.018, 0.969, 1.013)),
    "layer_norm": ((2048, 0.98, 0.784, 0.88, 0.754), (4096, 0.995, 0.831, 0.955, 0.78),
                   (8192, 0.998, 1.008, 0.975, 0.817)),
    "rope": ((1 << 30, 0.903, 0.948, 0.46, 0.472),),
    "glu_packed": ((2048, 0.984, 1.031, 0.984, 0.903), (4096, 0.977, 1.018, 0.971, 0.915),
                   (8192, 0.969, 1.021, 0.968, 0.915)),
}
# LM head + loss fused and chunked, over matmul + Inductor's loss, fwd+bwd time at 4096 rows of hidden
# 2048, bf16, by vocabulary (runs/2026-12-03-h200-loss-3.json): slower at large vocabularies (each
# chunk re-reads and re-writes the dW accumulator), for half the peak memory
_LINEAR_CE_H200 = ((32000, 0.99), (128256, 1.08), (1 << 30, 1.12))
# AdamW, 42 fp32 tensors, 468.7M parameters (runs/2026-12-03-h200-optimizer-4.json, -2-forloop.json): ours 4.13 TB/s,
# Inductor 4.21 on the foreach graph and 3.95 on the for-loop graph; over the 4.3 TB/s of the profile
_MULTI_TENSOR_H200 = (0.96, 0.98, 0.92)
# the clip's norm pass over those gradients (runs/2026-12-04-h200-sum-squares.json, -optimizer-restack.json):
# ours 0.418 ms (4.49 TB/s); Inductor's clip + AdamW 4.264 ms against its AdamW 3.113, of which the
# clipped store at its update rate is 0.445 ms, so its norm 0.706 ms (2.66 TB/s)
_CLIP_NORM_H200 = (1.04, 0.62)
# GEMM + epilogue, bf16 (benchmarks/runs/2026-12-03-h200-gemm-{2,3}.json): Linear(8192, 8192) on 1024
# rows, 137 GFLOP: our kernel (TMA loads, untuned) with its epilogue 0.218 ms (80% of 790 TFLOP/s;
# forced, run 3), cuBLAS ~0.178 ms (98%); fwd+bwd of the fused regions ~1.13x Inductor's (16384 x 1024 -> 1024, run 2),
# the backward alone ~1.2x
_GEMM_H200 = (0.80, 0.98)
_GEMM_BACKWARD_H200 = 1.2
# routed experts, bf16 fwd+bwd (benchmarks/runs/2026-12-03-h200-moe-3.json): the HF Mixtral block at
# 8 experts / top-2 / 2048 / 4096 / 8192 tokens and 128 / top-8 / 2048 / 768 / 16384: our Triton grouped
# GEMMs 383 and 360 TFLOP/s, torch's grouped_mm (CUTLASS) 700 and 608 of 790; Inductor's passes around
# them 1.04 and 4.1 ms, ~1.7x their byte estimate at the copy rate (ours 0.61 and 2.1 ms, ~1.0x);
# torchtitan's spelling at the first shape (runs/2026-12-03-h200-moe-titan.json): Inductor's passes
# 0.70-0.78 ms, ~1.25x (ours, with gate/up apart and the weight on the input, 0.85 and 1.70 ms)
_MOE_H200 = (0.47, 0.83, {"grouped_mm": 1.7, "batched_mm": 1.7, "torchtitan": 1.25})
# benchmarks/runs/2026-12-03-h200-horizontal-1.json: one LlamaDecoderLayer (2048, 32/8 heads, ffn 8192,
# 2 x 2048 tokens, bf16): Inductor 0.827 / 2.817 ms, concatenated 0.870 / 2.857 ms: slower
_HORIZONTAL_H200 = (1.052, 1.014)
# the same on the H100 (benchmarks/runs/2026-12-05-h100-horizontal.json): Inductor 0.881 / 2.959 ms,
# concatenated 0.937 / 3.015 ms
_HORIZONTAL_H100 = (1.064, 1.019)
# torch._scaled_mm e4m3 at 8192^3: H100 1276 TFLOP/s (../shared/anchors/), H200 1483
# (runs/2026-12-03-h200-fp8-1.json). Overhead: on the reference Llama step (runs/2026-12-03-h200-llama-
# step-fp8.json) the 12 MLP linears in FP8 were estimated 1.0 ms faster and measured 2.3 ms slower:
# ~275 us per linear in training beyond the estimate, ~90 us per GEMM (its launches from Python: the
# op's dispatch, the quantization kernels); the H100 is assumed to match. Host time: a step replayed as
# CUDA graphs does not pay it (stop 20, runs/2026-12-04-h200-llama-step-fp8-cg.json: every linear in
# FP8, GPU time 26.2 ms, wall 42.7 ms launched op by op, 29.1 ms replayed)
_FP8_H100, _FP8_H200, _FP8_OVERHEAD = 1276e12, 1483e12, 90e-6
# host time of one project-op call over an ATen op's (benchmarks/host_overhead.py, H200 machine, stop
# 21: our RMSNorm op 94 us against F.rms_norm's 12 in run 2, 60 against 11 in run 3 after the cheaper
# registration and launch; a backward op allocates and reduces more, so this is a lower bound). On
# the reference Llama step the nine RMSNorm regions (est. 3.7 us of GPU time saved each) cost 0.1-2.1
# ms of wall time in five runs (GPU time equal): a region must save more than the host time of its op
# calls; the H100 is assumed to match
_OP_HOST = 50e-6
# benchmarks/runs/2026-12-05-h100-topk-bitonic.json, fp32 rows, forward, us: torch.topk (select + sort)
# 23.0 for 8192 x 8 (k = 2), 166.8 for 65536 x 8 (k = 2), 61.9 for 16384 x 60 (k = 4), 109.0 for 16384 x
# 128 (k = 8), 202.9 for 16384 x 256 (k = 8); fusion::topk 1.4, 3.0, 8.7, 18.0, 39.4. Per row: torch
# ~2.3 ns + 0.04 ns per element; ours fitted through the third and the last at 0.28 ns + 1.05 ps per
# element x k (above the others). The H200 (the same GH100 chip) is assumed to match
_TOPK_H100 = (2.3e-9, 0.04e-9, 0.28e-9, 1.05e-12)
PROFILES = {
    # the H100's attention, multi-tensor, GEMM and MoE figures: assumed the H200's (one GH100 chip;
    # only the H200 was measured)
    "h100": DeviceProfile("h100", 3.0e12, 4e-6, _H100, matmul_flops=737e12, attention=_ATTENTION_H200,
                          multi_tensor=_MULTI_TENSOR_H200, clip_norm=_CLIP_NORM_H200, gemm=_GEMM_H200,
                          gemm_backward=_GEMM_BACKWARD_H200, moe=_MOE_H200,
                          horizontal=_HORIZONTAL_H100, fp8_flops=_FP8_H100, fp8_overhead_s=_FP8_OVERHEAD,
                          op_host_s=_OP_HOST, topk=_TOPK_H100),
    "h200": DeviceProfile("h200", 4.3e12, 4e-6, _H200, matmul_flops=790e12, attention=_ATTENTION_H200,
                          linear_cross_entropy=_LINEAR_CE_H200, multi_tensor=_MULTI_TENSOR_H200,
                          clip_norm=_CLIP_NORM_H200, gemm=_GEMM_H200, gemm_backward=_GEMM_BACKWARD_H200,
                          moe=_MOE_H200, horizontal=_HORIZONTAL_H200, fp8_flops=_FP8_H200,
                          fp8_overhead_s=_FP8_OVERHEAD, op_host_s=_OP_HOST, topk=_TOPK_H100),
}
REFERENCE = "h200"

# kernel -> (our launches fwd, bwd; Inductor's launches fwd, bwd)
LAUNCHES = {
    "rms_norm": (1, 2, 1, 2), "add_rms_norm": (1, 2, 1, 2), "layer_norm": (1, 3, 1, 2),
    "rope": (1, 1, 1, 1), "glu": (1, 1, 1, 1), "glu_packed": (1, 1, 1, 2),
}


def profile_for(device: torch.device, name: Optional[str] = None) -> DeviceProfile:
    if name is not None:
        if name not in PROFILES:
            raise ValueError(f"device_profile={name!r}: known {sorted(PROFILES)}")
        return PROFILES[name]
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device).lower()
        for key in PROFILES:
            if key in gpu:
                return PROFILES[key]
    return PROFILES[REFERENCE]


@dataclasses.dataclass(frozen=True)
class CostContext:
    profile: DeviceProfile
    baseline: str  # "inductor" | "eager"
    training: bool  # does any region input need a gradient (set per match by the engine)
    prefer_memory: bool = False  # FusionConfig.prefer_memory
    replayed: bool = False  # FusionConfig.cudagraphs: the step is replayed as CUDA graphs (no host cost per op)

    @classmethod
    def of(cls, device: torch.device, config, training: bool) -> "CostContext":
        """The context a FusionConfig gives a region on `device` (explain() keeps the config's
        baseline and cudagraphs, although its own hand-off is eager)."""
        return cls(profile_for(device, config.device_profile), config.baseline, training, config.prefer_memory,
                   config.cudagraphs)


@dataclasses.dataclass(frozen=True)
class Estimate:
    ours_s: float
    baseline_s: float
    ours_bytes: int
    baseline_bytes: int
    baseline: str
    note: str = ""

    # set when a rewrite is taken for the memory it saves at a bounded time cost (prefer_memory)
    memory_trade: bool = False
    margin: float = MARGIN  # how much faster ours must be estimated

    @property
    def profitable(self) -> bool:
        return self.memory_trade or self.ours_s < self.baseline_s * (1.0 - self.margin)

    @property
    def bytes_saved(self) -> int:
        return self.baseline_bytes - self.ours_bytes

    @property
    def time_saved_s(self) -> float:
        return self.baseline_s - self.ours_s

    def reason(self) -> str:
        verdict = "less memory, prefer_memory=True" if self.memory_trade else \
            "fused kernel" if self.profitable else f"keep {self.baseline}"
        extra = f"; {self.note}" if self.note else ""
        return (f"{verdict}: est. {self.ours_s * 1e6:.1f} us vs {self.baseline} {self.baseline_s * 1e6:.1f} us"
                f" ({self.ours_bytes / 2**20:.1f} vs {self.baseline_bytes / 2**20:.1f} MiB){extra}")


def with_host_time(estimate: Estimate, calls: int, ctx: CostContext) -> Estimate:
    """The estimate with the host time of `calls` project-op calls added to ours where the step is
    launched op by op against Inductor (outside CUDA graphs; eager pays host time per op too): a
    region whose GPU saving is smaller than that costs wall time."""
    p = ctx.profile
    if calls == 0 or p.op_host_s == 0.0 or ctx.replayed or ctx.baseline != "inductor":
        return estimate
    host = calls * p.op_host_s
    note = (f"host time of {calls} op call(s) {host * 1e6:.0f} us included (launched op by op; "
            f"FusionConfig(cudagraphs=True) replays them)")
    return dataclasses.replace(estimate, ours_s=estimate.ours_s + host,
                               note=f"{estimate.note}; {note}" if estimate.note else note)


def nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def efficiency(profile: DeviceProfile, kernel: str, width: int, training: bool) -> tuple[float, float, str]:
    """(ours, Inductor's, where the figures come from) at this row width: the first measured row at or
    above it (the widest row beyond the widest measurement)."""
    rows = profile.efficiency.get(kernel, ())
    if not rows:
        eff = profile.default_efficiency
        return eff, eff, f"not measured on {profile.name}: assumed equal to Inductor"
    row = next((r for r in rows if width <= r[0]), rows[-1])
    ours, inductor = (row[3], row[4]) if training else (row[1], row[2])
    at = "" if row[0] >= 1 << 30 else f" at width {row[0]}"
    return ours, inductor, f"{'fwd+bwd' if training else 'fwd'} measured on {profile.name}{at}"


def estimate_fused(match, ctx: CostContext) -> Estimate:
    """Default should_apply: one fused kernel (fwd, and bwd when training) against the baseline."""
    kernel = match.pattern.kernel
    ins = match.tensor_inputs()
    outs = [val(o) for o in match.outputs]
    io_in, io_out = sum(map(nbytes, ins)), sum(map(nbytes, outs))
    fused = io_in + io_out + (io_out + 2 * io_in if ctx.training else 0)
    ours_l = LAUNCHES.get(kernel, (1, 2, 1, 2))
    launches = ours_l[0] + (ours_l[1] if ctx.training else 0)
    width = max((t.shape[-1] for t in ins if t.dim() > 0), default=1)
    p = ctx.profile
    eff_ours, eff_ind, source = efficiency(p, kernel, width, ctx.training)
    ours_s = launches * p.launch_s + fused / (p.bandwidth * eff_ours)
    if ctx.baseline == "inductor":
        base_l = ours_l[2] + (ours_l[3] if ctx.training else 0)
        base_bytes = fused
        base_s = base_l * p.launch_s + fused / (p.bandwidth * eff_ind)
    else:
        interior = [n for n in match.nodes if n.op == "call_function"]
        fwd = sum(nbytes(val(n)) + sum(nbytes(val(a)) for a in n.all_input_nodes) for n in interior)
        base_bytes = fwd * (3 if ctx.training else 1)
        base_l = len(interior) * (3 if ctx.training else 1)
        base_s = base_l * p.launch_s + base_bytes / (p.bandwidth * p.eager_efficiency)
    note = f"width {width}, {source}"
    if ctx.prefer_memory and ctx.training and match.pattern.family == "norm" and \
            any(isinstance(o, fx.Node) and recompute.only_matmul_operands(o) for o in match.outputs):
        # our kernel's output would be saved for the matmuls; Inductor's is recomputed (recompute.py)
        return Estimate(max(ours_s, base_s), base_s, fused, base_bytes, ctx.baseline,
                        f"{note}; prefer_memory=True: Inductor's norm output feeds only matmuls and is "
                        f"recomputed in the backward instead of saved")
    return Estimate(ours_s, base_s, fused, base_bytes, ctx.baseline, note)


def _by_length(rows, length: int) -> float:
    return next((eff for top, eff in rows if length <= top), rows[-1][1])


def estimate_attention(match, ctx: CostContext, kernel: str, density: float = 1.0) -> Estimate:
    """A fused attention kernel (ATTENTION kinds: flash, flash_causal, sdpa_mask, flex,
    flex_score_mod) against the unfused spelling, which materializes the B*H*Lq*Lk scores: written by
    the first matmul, read and written by softmax (and the mask), read by the second matmul; about
    twice as many passes again in the backward. Both do the matmul FLOPs (the unfused one at cuBLAS
    efficiency, ~0.7); the fused kernel only on the `density` fraction of score tiles it computes."""
    q, k, v = match.tensor_inputs()[:3]
    b_h = q.numel() // (q.shape[-2] * q.shape[-1])
    lq, lk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    flops = 4 * b_h * lq * lk * d * (3.5 if ctx.training else 1.0)
    p = ctx.profile
    io = sum(map(nbytes, (q, k, v))) + nbytes(q) * (4 if ctx.training else 1)
    eff = _by_length(p.attention[kernel], lk)
    ours_s = 2 * p.launch_s + max(flops * density / (p.matmul_flops * eff), io / p.bandwidth)
    scores = b_h * lq * lk * q.element_size() * (12 if ctx.training else 4)
    base_l = 5 * (3 if ctx.training else 1)
    base_s = base_l * p.launch_s + flops / (p.matmul_flops * 0.7) + scores / p.bandwidth
    if ctx.baseline == "eager":
        base_s += scores / p.bandwidth  # eager does not fuse the mask and scale into the softmax
    else:
        base_s *= _by_length(p.attention["unfused"], lk)
    return Estimate(ours_s, base_s, io, io + scores, ctx.baseline,
                    f"{kernel}; {lq}x{lk} scores per head not materialized; work on {density:.0%} of the score tiles"
                    f"; {flops / 1e9:.1f} GFLOP")


MEMORY_TRADE_MAX = 1.15  # prefer_memory takes a rewrite at most this much slower than its baseline


def estimate_linear_cross_entropy(match, ctx: CostContext) -> Estimate:
    """The chunked LM head + loss against matmul + Inductor's fused loss: the same three GEMMs (one
    without a gradient) and about the same logit traffic; the measured time ratio (by vocabulary)
    decides. Its point is memory: the (N, V) logits, their fp32 upcast and their gradient never exist
    whole (a chunk of at most 256 MiB does). Slower but smaller is taken only with prefer_memory."""
    tensors = match.tensor_inputs()
    h, w = tensors[0], tensors[1]
    n, v, hdim = h.shape[0], w.shape[0], h.shape[1]
    p = ctx.profile
    flops = 2 * n * v * hdim * (3 if ctx.training else 1)
    logits = n * v * h.element_size()
    base_bytes = logits * (8 if ctx.training else 3) + (n * v * 4 if ctx.training else 0)
    base_s = flops / (p.matmul_flops * 0.8) + base_bytes / (p.bandwidth * p.default_efficiency)
    if p.linear_cross_entropy and ctx.training:
        ratio = next((r for top, r in p.linear_cross_entropy if v <= top), p.linear_cross_entropy[-1][1])
        source = f"fwd+bwd measured on {p.name}"
    else:
        ratio, source = 1.0, f"not timed on {p.name}: assumed equal"
    if ctx.training and match.pattern.name.endswith("_none"):
        # per-token losses: the backward runs the logits GEMM again (4 GEMMs against Inductor's 3)
        ratio *= 4 / 3
        source += ", x4/3 for the backward's second logits GEMM (reduction none)"
    saved = (logits * 2 + n * v * 4) if ctx.training else logits
    trade = ctx.prefer_memory and ratio <= MEMORY_TRADE_MAX and ratio >= 1.0 - MARGIN
    return Estimate(base_s * ratio, base_s, logits, logits + saved, ctx.baseline,
                    f"{source}: x{ratio:.2f} time; logits {n}x{v} never materialized: ~{saved / 2**30:.2f} GiB "
                    f"less peak memory; {flops / 1e12:.2f} TFLOP of GEMMs either way", memory_trade=trade)


def estimate_embedding(match, ctx: CostContext) -> Estimate:
    """The lookup is the same gather either way; the backward differs. Inductor scatter-adds into an
    fp32 copy of the table (bf16/fp16 weights: zero 4VH bytes, atomics on the rows, read 4VH, write
    2VH); ATen's CUDA kernel sums sorted rows in fp32 partials the size of the tokens and writes the
    table once (2VH). Only the Inductor baseline in training with a low-precision table differs."""
    weight, indices = match.tensor_inputs()[:2]
    v, h, n = weight.shape[0], weight.shape[1], indices.numel()
    es = weight.element_size()
    fwd = n * h * es * 2
    p = ctx.profile
    bw = p.bandwidth * p.default_efficiency
    if not ctx.training or ctx.baseline != "inductor" or weight.dtype == torch.float32:
        why = "no table gradient" if not ctx.training else \
            f"{ctx.baseline} computes the same backward" if ctx.baseline != "inductor" else \
            "fp32 table: Inductor accumulates in place"
        return Estimate(fwd / bw, fwd / bw, fwd, fwd, ctx.baseline, f"{why}: the same gather")
    theirs = fwd + 10 * v * h + n * h * (es + 8)
    ours = fwd + 2 * v * h + n * h * (es + 12)
    return Estimate(ours / bw + 3 * p.launch_s, theirs / bw, ours, theirs, ctx.baseline,
                    f"table gradient accumulated without Inductor's {v}x{h} fp32 copy: "
                    f"~{4 * v * h / 2**30:.2f} GiB less peak memory")


def estimate_topk(scores, k: int, ctx: CostContext) -> Estimate:
    """fusion::topk (one launch: k rounds of a max over the rows it holds) against torch.topk, which
    Inductor keeps (a radix select per row, then a second launch sorting the k winners), each at its
    time per row measured on the card. The backward (zeros, then a scatter of the values' gradient) is
    the same on both sides."""
    p = ctx.profile
    width = scores.shape[-1]
    rows = scores.numel() // max(width, 1)
    moved = scores.numel() * scores.element_size() + rows * k * (scores.element_size() + 8)
    floor = moved / p.bandwidth
    if not p.topk:
        return Estimate(floor, floor, moved, moved, ctx.baseline, f"top-k not timed on {p.name}: keep torch.topk")
    theirs_base, theirs_element, ours_base, ours_element = p.topk
    ours = p.launch_s + max(floor, rows * (ours_base + ours_element * width * k))
    theirs = 2 * p.launch_s + max(floor, rows * (theirs_base + theirs_element * width))
    estimate = Estimate(ours, theirs, moved, moved, ctx.baseline,
                        f"{rows} rows of {width}: times per row measured on the H100"
                        f"{'' if p.name == 'h100' else f' (assumed on {p.name})'}")
    # host time: the op and, in training, its backward (benchmarks/host_overhead.py, H100 machine:
    # fusion.topk 31 us against torch.topk's 13 forward, 207 against 125 us forward + backward)
    return with_host_time(estimate, 2 if ctx.training else 1, ctx)


def estimate_multi_tensor(ours_bytes: int, inductor_bytes: int, eager_bytes: int, eager_ops: int, lanes: int,
                          foreach: bool, ctx: CostContext, norm_bytes: int = 0) -> Estimate:
    """A multi-tensor update (an optimizer step): one launch over all lanes, each slot read once and
    each written slot written once. Inductor fuses each lane's update too (the same bytes, unless our
    update skips a store) in per-lane kernels, grouped when the graph has foreach ops; its measured
    bandwidth depends on that spelling (DeviceProfile.multi_tensor). Eager launches every op of
    every lane and moves every intermediate. norm_bytes: the gradients a global-norm clip in the same
    graph reads first (our sum-of-squares launch, Inductor's norms: DeviceProfile.clip_norm)."""
    p = ctx.profile
    ours_eff, foreach_eff, loop_eff = p.multi_tensor or (p.default_efficiency,) * 3
    ours_norm, base_norm = p.clip_norm or (p.default_efficiency,) * 2
    ours_s = p.launch_s + ours_bytes / (p.bandwidth * ours_eff) + norm_bytes / (p.bandwidth * ours_norm)
    ours_bytes += norm_bytes
    if ctx.baseline == "inductor":
        base_bytes = inductor_bytes + norm_bytes
        launches = -(-lanes // 8) if foreach else lanes
        base_s = launches * p.launch_s + inductor_bytes / (p.bandwidth * (foreach_eff if foreach else loop_eff)) + \
            norm_bytes / (p.bandwidth * base_norm)
    else:
        base_bytes = eager_bytes + norm_bytes
        base_s = eager_ops * p.launch_s + base_bytes / (p.bandwidth * p.eager_efficiency)
    spelling = "foreach" if foreach else "for-loop"
    return Estimate(ours_s, base_s, ours_bytes, base_bytes, ctx.baseline, note=f"{lanes} tensors, {spelling} spelling")


def _gemm_time(flops: float, nbytes: int, eff: float, p: DeviceProfile) -> float:
    return p.launch_s + max(flops / (p.matmul_flops * eff), nbytes / p.bandwidth)


def gemm_backward_s(flops: float, operands: int, product: int, side_bytes: int, p: DeviceProfile) -> float:
    """The backward of a GEMM + epilogue: the derivative pass and the two GEMMs (cuBLAS)."""
    return 2 * _gemm_time(flops, operands + product, p.gemm[1], p) + \
        (3 * product + side_bytes) / (p.bandwidth * p.default_efficiency) + p.launch_s


def estimate_gemm_epilogue(a, b, sides: list, shape, out, n_ops: int, save_product: bool,
                           ctx: CostContext) -> Estimate:
    """The GEMM with its chain in the epilogue against the GEMM (cuBLAS) writing the product and one
    fused elementwise kernel (Inductor) or one kernel per op (eager) reading it back. Ours is a
    Triton GEMM: DeviceProfile.gemm holds its efficiency against cuBLAS's. Training adds the same
    backward to both (the derivative pass and two GEMMs), except that ours writes the product only
    when the backward reads it."""
    p = ctx.profile
    m_n = 1
    for size in shape:
        m_n *= size
    k = a.shape[-1]
    flops = 2.0 * m_n * k
    operands, side_bytes, out_bytes = nbytes(a) + nbytes(b), sum(map(nbytes, sides)), nbytes(out)
    product = m_n * a.element_size()
    ours_eff, cublas_eff = p.gemm
    ours_bytes = operands + side_bytes + out_bytes + (product if save_product else 0)
    ours = _gemm_time(flops, ours_bytes, ours_eff, p)
    gemm = _gemm_time(flops, operands + product, cublas_eff, p)
    if ctx.baseline == "inductor":
        epilogue_bytes = product + side_bytes + out_bytes
        base = gemm + p.launch_s + epilogue_bytes / (p.bandwidth * p.default_efficiency)
    else:
        epilogue_bytes = n_ops * (2 * product) + side_bytes
        base = gemm + n_ops * p.launch_s + epilogue_bytes / (p.bandwidth * p.eager_efficiency)
    base_bytes = operands + product + epilogue_bytes
    if ctx.training:
        backward = gemm_backward_s(flops, operands, product, side_bytes, p)
        ours, base = ours + backward * p.gemm_backward, base + backward
    return Estimate(ours, base, ours_bytes, base_bytes, ctx.baseline,
                    f"{flops / 1e9:.2f} GFLOP; GEMM at {ours_eff:.0%} of {p.matmul_flops / 1e12:.0f} TFLOP/s "
                    f"(cuBLAS {cublas_eff:.0%}, {p.name} profile); product {'saved' if save_product else 'not written'}")


def estimate_moe(shape: dict, impl: str, ctx: CostContext) -> Estimate:
    """Routed experts (shape: tokens, top_k, width, ffn, experts, gated, dtype; and spelling,
    separate: gate and up weights apart, scale_input: the routing weight on the experts' input) as
    fusion::moe_experts with `impl` against the spelling's own graph under the baseline: both run the
    same FLOPs (two or three grouped GEMMs forward, twice that backward); they differ in the GEMMs'
    efficiency and in the passes around them. The spelling gathers the token rows into a permuted copy,
    runs the activation as its own pass, then scales, un-permutes and sums the slots (and the mirror
    image backward), at its measured factor over this byte count (DeviceProfile.moe, per spelling);
    ours (Triton) gathers rows inside the GEMMs and writes each slot once in fp32 for the sum, forward
    (output) and backward (input gradient); grouped_mm keeps the copies (codegen/moe_grouped_mm.py's
    passes, each reading and writing once; with gate and up apart the combine of the input gradient
    reads two products' rows; with the weight on the input, the spread scales the rows and the
    backward's combine dots them with x for the weights' gradient). A per-expert loop's
    weights are stacked first (stacked_bytes: a copy, and its gradient split back). The dense spelling
    (every expert on every token, gates zero outside the top k) runs E / k times the FLOPs as batched
    GEMMs, and its [T, E, .] intermediates."""
    p = ctx.profile
    rows, width, ffn = shape["tokens"] * shape["top_k"], shape["width"], shape["ffn"]
    b, g = torch.empty(0, dtype=shape["dtype"]).element_size(), 2 if shape["gated"] else 1
    flops = 2.0 * rows * width * ffn * (g + 1) * (3 if ctx.training else 1)
    out = shape["tokens"] * width * b
    gemm_io = rows * (2 * width + (2 * g + 1) * ffn) * b * (3 if ctx.training else 1)
    spelling = rows * (4 * width + (g + 1) * ffn) * b + out  # gather copy, activation pass, scale + un-permute
    slots = 2 * rows * width * 4 + out  # fp32 slots written, read back for the sum
    if ctx.training:
        spelling += rows * (6 * width + (2 * g + 1) * ffn) * b + rows * width * 4
        slots += 2 * rows * width * 4 + out + rows * (g + 1) * ffn * b  # d slots; the saved activations read
    passes_bw = p.bandwidth * p.default_efficiency
    if not p.moe:
        ours = flops / (p.matmul_flops * p.gemm[1]) + spelling / passes_bw
        if shape.get("spelling") in ("dense", "per-expert"):
            return Estimate(ours, _unfused_moe_s(shape, flops, spelling, ctx), gemm_io + spelling,
                            gemm_io + spelling, ctx.baseline, f"grouped GEMMs not measured on {p.name}: the "
                            f"{shape['spelling']} spelling's GEMMs at its plain GEMM efficiency")
        return Estimate(ours, ours, gemm_io + spelling, gemm_io + spelling, ctx.baseline,
                        f"grouped GEMMs not measured on {p.name}: assumed equal to {ctx.baseline}")
    triton_eff, gmm_eff, factors = p.moe
    spelling_factor = factors.get(shape.get("spelling", "grouped_mm"), factors["grouped_mm"])
    if ctx.baseline == "eager":
        spelling_factor *= 2  # one kernel per op, not Inductor's fused passes
    gmm_s = flops / (p.matmul_flops * gmm_eff)
    base = gmm_s + spelling * spelling_factor / passes_bw
    if shape.get("spelling") in ("dense", "per-expert"):
        base = _unfused_moe_s(shape, flops, spelling, ctx)
    if impl == "triton":
        ours_bytes, ours = gemm_io + slots, flops / (p.matmul_flops * triton_eff) + slots / passes_bw
        eff = triton_eff
    else:  # one kernel of ours a pass: the token rows spread to the slots, the GLU (the weight on its rows),
        # the slots summed; backward the output gradient spread, the GLU's (and the weight's), the sum
        passes = rows * (2 * width + (g + 1) * ffn) * b + 2 * out
        if ctx.training:
            passes += rows * (2 * width + (2 * g + 1) * ffn) * b + 2 * out
        if shape.get("separate") and ctx.training:  # the combine reads both products' rows of d x
            passes += rows * width * b
        if shape.get("scale_input") and ctx.training:  # the rows are scaled as they are spread; the
            passes += out  # backward's combine reads x for the weights' dots
        ours_bytes, ours, eff = gemm_io + passes, gmm_s + passes / passes_bw, gmm_eff
    stacked = shape.get("stacked_bytes", 0) * (3 if ctx.training else 2)  # a ModuleList's weights copied to [E, ...]
    ours, ours_bytes = ours + stacked / passes_bw, ours_bytes + stacked
    return Estimate(ours, base, ours_bytes, gemm_io + spelling, ctx.baseline,
                    f"{flops / 1e9:.1f} GFLOP; grouped GEMMs at {eff:.0%} of {p.matmul_flops / 1e12:.0f} TFLOP/s "
                    f"(torch's grouped_mm {gmm_eff:.0%}; the spelling's passes x{spelling_factor:.1f}, {p.name} profile)")


# a per-expert loop captured in one graph waits on the host once an expert (torch.where's size): the
# transformers 4.x Mixtral block under Inductor ran 7.84 ms wall for 5.05 ms of kernels with 8 experts
# (benchmarks/runs/2026-12-04-h200-moe-spellings.json): 0.35 ms an expert, forward and backward
LOOP_EXPERT_S = 350e-6


def _unfused_moe_s(shape: dict, flops: float, spelling: float, ctx: CostContext) -> float:
    """The spellings without grouped GEMMs, as plain GEMMs with the spelling's passes: the dense one
    runs every expert on every token (E / k times the routed work, no row gathers), a per-expert loop
    one small GEMM each and a host sync an expert."""
    p, b = ctx.profile, torch.empty(0, dtype=shape["dtype"]).element_size()
    bandwidth = p.bandwidth * p.default_efficiency
    if shape["spelling"] == "per-expert":
        stall = LOOP_EXPERT_S if ctx.training else LOOP_EXPERT_S / 2
        return flops / (p.matmul_flops * p.gemm[1]) + spelling / bandwidth + shape["experts"] * stall
    gathers = shape["tokens"] * shape["top_k"] * shape["width"] * b * 2 * (2 if ctx.training else 1)
    return (flops / (p.matmul_flops * p.gemm[1]) + (spelling - gathers) / bandwidth) * shape["experts"] / shape["top_k"]


def estimate_fp8_linear(m: int, n: int, k: int, element_size: int, per_row: bool, ctx: CostContext,
                        x_cast: str = "own", readers: int = 1) -> Estimate:
    """x [m, k] @ w [n, k]^T (and in training dx and dW) as FP8 GEMMs against cuBLAS in the operands'
    dtype. FP8 adds quantization passes, and the host overhead per GEMM measured on a whole train step
    (DeviceProfile.fp8_overhead_s), not paid where the step is replayed as CUDA graphs (ctx.replayed):
    - per-row scales: each operand read once and written as FP8 bytes, in training also w along N and
      dy, x along M for the backward (longer rows' amax passes are not counted);
    - a per-tensor scale: x, w and (training) dy each read twice (an amax pass, then the cast) and
      written once per layout (two in training: the backward takes the transposes' FP8 bytes); with
      ctx.prefer_memory the backward casts w again into its transpose (held from the forward otherwise).
    x's forward cast: "own" (this linear's pass), "shared" (one pass for the `readers` linears of x)
    or "fused" (per-row: the FP8 copy written by x's producer: only its bytes, shared by the readers)."""
    p = ctx.profile
    if not p.fp8_flops:
        base = 0.0
        return Estimate(base, base, 0, 0, ctx.baseline, f"FP8 GEMMs not measured on {p.name}: keep {ctx.baseline}")
    products = [(m, n, k)] + ([(m, k, n), (n, k, m)] if ctx.training else [])

    def gemm_s(rate: float, eff: float, mm: int, nn: int, kk: int, es: float) -> float:
        flops = 2.0 * mm * nn * kk
        moved = (mm * kk + nn * kk + mm * nn) * es
        return p.launch_s + max(flops / (rate * eff * _wave_efficiency(mm, nn, p.sms)), moved / p.bandwidth)
    high = sum(gemm_s(p.matmul_flops, p.gemm[1], *mnk, element_size) for mnk in products)
    low = sum(gemm_s(p.fp8_flops, 1.0, *mnk, 1) for mnk in products)
    moved = sum(mm * kk + nn * kk + mm * nn for mm, nn, kk in products)
    if per_row:  # w; in training dy by rows and by columns, w^T, x^T
        operands, passes, each = [n * k] + ([m * n, m * n, n * k, m * k] if ctx.training else []), 1, element_size + 1
    else:  # w; in training dy: both layouts from one cast
        operands, passes = [n * k] + ([m * n] if ctx.training else []), 2
        each = 2 * element_size + (2 if ctx.training else 1)
    share = 1 if x_cast == "own" else readers
    x_bytes = m * k * (1 if x_cast == "fused" else each) / share
    recast = not per_row and ctx.training and ctx.prefer_memory  # w read twice more, in the backward
    quant_bytes = int(sum(operands) * each + x_bytes + (n * k * 2 * element_size if recast else 0))
    launches = len(operands) + (0 if x_cast == "fused" else 1 / share) + (1 if recast else 0)
    quant = quant_bytes / (p.bandwidth * p.default_efficiency) + launches * passes * p.launch_s
    quant += 0.0 if ctx.replayed else len(products) * p.fp8_overhead_s
    return Estimate(low + quant, high, moved + quant_bytes, moved * element_size, ctx.baseline,
                    f"{len(products)} GEMM(s) of {m}x{n}x{k}: FP8 {low * 1e6:.1f} us + quantization and overhead {quant * 1e6:.1f} us "
                    f"({quant_bytes / 2**20:.1f} MiB) vs {element_size * 8}-bit {high * 1e6:.1f} us ({p.name} profile)")


def timed_gemm_epilogue(ours_s: float, baseline_s: float, baseline: str, ours_bytes: int, baseline_bytes: int,
                        backward_s: float, ctx: CostContext) -> Estimate:
    """Forward times measured on this device: ours (the generated kernel at its best tuned config)
    against the hand-off's (`baseline` names what was timed: patterns/gemm.py `_timed`); in training
    both add the estimated backward, ours scaled by the measured DeviceProfile.gemm_backward. Ours must
    be TIMED_MARGIN faster: the spread of such compile-time timings."""
    p = ctx.profile
    note = f"timed on {p.name}: ours {ours_s * 1e6:.1f} us, {baseline} {baseline_s * 1e6:.1f} us (forward)"
    if ctx.training:
        ours_s, baseline_s = ours_s + backward_s * p.gemm_backward, baseline_s + backward_s
        note += f"; backward est. {backward_s * 1e6:.1f} us, ours x{p.gemm_backward:.2f}"
    note += f"; taken at {TIMED_MARGIN:.0%} faster or more (the timings' spread)"
    return Estimate(ours_s, baseline_s, ours_bytes, baseline_bytes, ctx.baseline, note, margin=TIMED_MARGIN)


def _wave_efficiency(m: int, n: int, sms: int, tile: int = 128) -> float:
    """The fraction of SM slots a GEMM's 128x128 output tiles fill over its waves."""
    tiles = -(-m // tile) * -(-n // tile)
    return tiles / (-(-tiles // sms) * sms)


def estimate_horizontal(a, weights: list, ctx: CostContext) -> Estimate:
    """Linears sharing their input as one GEMM over concatenated weights, against one GEMM each
    (cuBLAS for both). Fused: one launch and fuller tile waves, but the weights are concatenated every
    call (read + write) and, in training, the output gradients are concatenated for the backward
    (read + write) while the weight gradients come back as views; separate: a launch and a wave tail
    per linear and, in training, the input gradients of all but one added up."""
    p = ctx.profile
    m, k, es = a.numel() // a.shape[-1], a.shape[-1], a.element_size()
    ns = [w.shape[0] for w in weights]
    passes = 3 if ctx.training else 1  # forward, then the input and the weight gradients

    def gemm_s(n: int) -> float:
        flops = 2.0 * m * n * k
        moved = (m * k + n * k + m * n) * es
        return p.launch_s + max(flops / (p.matmul_flops * p.gemm[1] * _wave_efficiency(m, n, p.sms)),
                                moved / p.bandwidth)
    separate = passes * sum(gemm_s(n) for n in ns)
    concat = 2 * sum(ns) * k * es + (2 * m * sum(ns) * es if ctx.training else 0)
    fused = passes * gemm_s(sum(ns)) + p.launch_s * (2 if ctx.training else 1) + concat / p.bandwidth
    if ctx.training:
        separate += (len(ns) - 1) * (p.launch_s + 3 * m * k * es / p.bandwidth)
    reread = (len(ns) - 1) * m * k * es * passes  # the shared input, read once instead of once per linear
    return Estimate(fused, separate, concat, concat + reread, ctx.baseline,
                    f"{len(ns)} x [{m}, {k}] @ [{k}, {'/'.join(map(str, ns))}]; concatenation "
                    f"{concat / 2**20:.1f} MiB moved; wave fill {_wave_efficiency(m, sum(ns), p.sms):.2f} vs "
                    f"{min(_wave_efficiency(m, n, p.sms) for n in ns):.2f}")
