"""FusionConfig: one frozen, hashable description of what the backend may do."""
import dataclasses
from typing import Optional

HANDOFFS = ("inductor", "aot_eager", "eager")
COST_MODELS = ("roofline", "always")
BASELINES = ("inductor", "eager")
MOE_IMPLS = ("auto", "triton", "grouped_mm")
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_gw_hp")


class ConfigError(ValueError):
    """A configuration the user must fix (raised, never turned into a fallback)."""


def _names(value) -> Optional[frozenset]:
    if value is None:
        return None
    if isinstance(value, str):
        return frozenset([value])
    return frozenset(value)


@dataclasses.dataclass(frozen=True)
class FusionConfig:
    """What the `fusion` backend may rewrite and where it hands the rest.

    families / patterns: only these (None: all); disable_families / disable_patterns: never these.
    handoff: who compiles what is left: "inductor" (default), "aot_eager" or "eager" (debugging).
    cost_model: "roofline" decides each region by the cost model; "always" applies every legal
        match (for tests and debugging: it can be slower than Inductor).
    cost_baseline: what a rewrite is compared with: "inductor" (its fused kernels) or "eager"
        (one kernel per op). None: "inductor" when the hand-off is Inductor, else "eager".
    device_profile: the cost model's device figures ("h100", "h200"); None: from the device, and the
        reference GPU for CPU runs (so CPU tests see the decisions a GPU run would make).
    verify_kernels: run each new kernel signature once on random data at compile time; a kernel
        that fails to compile or run leaves its region to the hand-off, with the reason.
    drop_logits: in training, when a fused loss's logits are also returned by the graph and used for
        nothing else (HF causal LMs return outputs.logits beside outputs.loss), return an empty tensor
        in their place so that the full logits are never materialized (the loss and its gradients are
        unchanged). Off by default: a region whose logits are returned is a near-miss, and says so.
        Under fp8="tensorwise" the FP8 LM head fused with its cross-entropy (patterns/fp8_loss.py)
        needs its logits for the backward, so they are still made; dropping the returned ones spares
        autograd's all-zero gradient for them (a fill and a read; likely a copy into a CUDA graph too).
    prefer_memory: also take rewrites that cut peak memory at a measured time cost of at most 15% on
        their region (the chunked LM head + loss at large vocabularies: about half the memory of
        Inductor's, 8-12% slower at 128K-256K). Off by default: do no harm to speed. With fp8="tensorwise"
        it also makes the backward cast each weight again instead of holding its FP8 transpose from the
        forward (one byte a weight element; patterns/fp8.py).
    HF causal LMs, for the memory of the LM head + loss: FusionConfig(drop_logits=True, prefer_memory=True).
    overlap_collectives: with the Inductor hand-off, schedule functional collectives (all-gather,
        reduce-scatter, all-reduce, all-to-all) to overlap with compute: overlap.py, a post-grad pass.
    overlap_memory_budget: bytes of estimated live memory the schedule may not exceed (None: no
        limit): a collective keeps its place when issuing it early would pass it, a wait comes
        forward when the next op would; if the order still passes it, the graph keeps its own.
    skip_clipped_grad_store: in an optimizer step fused with a global-norm gradient clip (one graph),
        do not write the clipped gradients back: p.grad keeps its unclipped values after the step, the
        update uses the clipped ones. Saves one write of every gradient; only for training loops that
        do not read p.grad after the step. Off by default (p.grad ends as eager leaves it).
    gemm_timing: on CUDA, time each GEMM + epilogue region's generated kernel (every tile config)
        against Inductor's compile of the same region once per shape, and fuse only where the
        kernel is at least 5% faster (cost.TIMED_MARGIN); the timings are kept on disk
        (codegen/tuning.py), so a shape is timed once per machine. Off: the roofline alone decides.
    fp8: None (off), or the FP8 recipe linears may be rewritten with (patterns/fp8.py, per GEMM by
        the cost model): "tensorwise" (per-tensor scales, e4m3 forward, e5m2 gradients), "rowwise"
        (per-row scales, e4m3), "rowwise_gw_hp" (rowwise, the weight gradient in high precision).
    fp8_emulate: compute the recipe's FP8 rounding in higher precision instead of FP8 GEMMs (any
        device: checks the numerics on CPU; never faster).
    fp8_fuse_cast: per-row recipes: a linear's input produced by a fusion RMSNorm or GLU is cast to
        FP8 in that kernel, one made by Inductor's code (a pointwise op or a copy) in Inductor's
        kernel, and an input read by several FP8 linears is cast once for all of them.
        Off: each FP8 linear casts its input itself (the same values).
    cudagraphs: hand the rewritten graphs to Inductor with its CUDA graphs on (what torch.compile's
        mode="reduce-overhead" sets; Inductor skips them where a graph cannot be captured). A step is
        replayed with one launch, so the host cost of each op (the project's ops pay Python dispatch
        and Triton launch costs on every call) no longer adds to the step time, and the cost model
        stops charging it: off, a region is taken only where its GPU time saved exceeds the host time
        of its op calls (DeviceProfile.op_host_s). Off by default, as in
        torch.compile: the outputs of a replayed graph are overwritten by the next replay.
    moe_impl: how routed experts run: "auto" (the cost model picks per shape), "triton" (generated
        grouped GEMMs gathering rows in-kernel) or "grouped_mm" (torch's grouped GEMM; bf16 on CUDA,
        16-byte aligned rows), where the operands allow it.
    overlap_chunks: all-gather -> matmul is split into this many chunks so that chunk i's all-gather
        overlaps chunk i-1's matmul (None: the cost model picks 1, 2, 4 or 8; 1: never split).
    capture_dynamic_output_shapes: while a model compiled by fusion_compiler.compile runs, Dynamo
        captures ops whose output size depends on the data (torch.where(mask), nonzero) instead of
        breaking the graph there (its capture_dynamic_output_shape_ops setting), so that a per-expert
        loop over a ModuleList (transformers 4.x MoE) is one graph the MoE family can take. (torch.compile
        drops a backend's Dynamo settings: there, set that torch._dynamo.config flag yourself.) A graph
        that keeps such sizes after the MoE rewrite skips the other families (a fallback row says so).
    """
    families: Optional[frozenset] = None
    patterns: Optional[frozenset] = None
    disable_families: frozenset = frozenset()
    disable_patterns: frozenset = frozenset()
    handoff: str = "inductor"
    cost_model: str = "roofline"
    cost_baseline: Optional[str] = None
    device_profile: Optional[str] = None
    verify_kernels: bool = True
    drop_logits: bool = False
    prefer_memory: bool = False
    overlap_collectives: bool = True
    overlap_memory_budget: Optional[float] = None
    overlap_chunks: Optional[int] = None
    skip_clipped_grad_store: bool = False
    gemm_timing: bool = True
    moe_impl: str = "auto"
    capture_dynamic_output_shapes: bool = True
    fp8: Optional[str] = None
    fp8_emulate: bool = False
    fp8_fuse_cast: bool = True
    cudagraphs: bool = False

    def __post_init__(self):
        for name in ("families", "patterns"):
            object.__setattr__(self, name, _names(getattr(self, name)))
        for name in ("disable_families", "disable_patterns"):
            object.__setattr__(self, name, _names(getattr(self, name)) or frozenset())
        if self.handoff not in HANDOFFS:
            raise ValueError(f"handoff={self.handoff!r}: expected one of {HANDOFFS}")
        if self.cost_model not in COST_MODELS:
            raise ValueError(f"cost_model={self.cost_model!r}: expected one of {COST_MODELS}")
        if self.fp8 is not None and self.fp8 not in FP8_RECIPES:
            raise ValueError(f"fp8={self.fp8!r}: expected None or one of {FP8_RECIPES}")
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl={self.moe_impl!r}: expected one of {MOE_IMPLS}")
        if self.cost_baseline is not None and self.cost_baseline not in BASELINES:
            raise ValueError(f"cost_baseline={self.cost_baseline!r}: expected one of {BASELINES}")

    @property
    def baseline(self) -> str:
        if self.cost_baseline is not None:
            return self.cost_baseline
        return "inductor" if self.handoff == "inductor" else "eager"

    def enables(self, pattern) -> bool:
        if pattern.family in self.disable_families or pattern.name in self.disable_patterns:
            return False
        if self.families is not None and pattern.family not in self.families:
            return False
        return self.patterns is None or pattern.name in self.patterns

    def check_names(self, patterns) -> None:
        """Raise for a pattern or family name that no registered pattern has (a typo disables nothing)."""
        names = {p.name for p in patterns}
        families = {p.family for p in patterns}
        for given, known, what in ((self.patterns, names, "pattern"), (self.disable_patterns, names, "pattern"),
                                   (self.families, families, "family"), (self.disable_families, families, "family")):
            unknown = sorted((given or frozenset()) - known)
            if unknown:
                raise ConfigError(f"unknown {what} name(s) {unknown}; known: {sorted(known)}")
