"""Every private PyTorch symbol the project uses, in one place, gated by version (and the Triton launch
internals codegen/launch.py uses).

tests/test_compat.py imports each name below and fails loudly when one moves.
Supported: torch 2.11 (the GPU machine) to 2.13 (CI).
"""
import torch
import triton

MIN_TORCH = (2, 11)
_version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
if _version < MIN_TORCH:
    raise ImportError(f"fusion_compiler needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}, found {torch.__version__}")

from torch._decomp import get_decompositions  # noqa: E402
from torch._dynamo.backends.debugging import aot_eager  # noqa: E402
from torch._dynamo.source import ConstantSource as _ConstantSource  # noqa: E402
from torch._guards import detect_fake_mode, tracing  # noqa: E402
from torch._inductor import config as inductor_config  # noqa: E402
from torch._inductor.compile_fx import compile_fx  # noqa: E402
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files  # noqa: E402
from torch._ops import HigherOrderOperator, OpOverload  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: E402

from torch.fx.experimental import symbolic_shapes as _symbolic_shapes  # noqa: E402
from torch.utils.checkpoint import CheckpointPolicy  # noqa: E402

# the node-metadata key of a selective-checkpoint policy: AOTAutograd copies it into the joint graph
# (torch.fx.proxy's copied fields) and the min-cut partitioner honours it (recompute.py)
RECOMPUTE_META = "recompute"


def size_hint(x, fallback: int = 4096) -> int:
    """A concrete value of a possibly symbolic int (the example the graph was traced at), for cost
    estimates only: adds no guard. Unbacked sizes get `fallback`."""
    if not isinstance(x, torch.SymInt):
        return int(x)
    if hasattr(_symbolic_shapes, "optimization_hint"):  # torch >= 2.12
        return _symbolic_shapes.optimization_hint(x, fallback=fallback)
    hint = x.node.hint  # torch 2.11
    return int(hint) if hint is not None else fallback


def sym_expr(x):
    """The sympy expression of a possibly symbolic int, in the shape environment's symbols (a plain
    int becomes a sympy Integer); adds no guard."""
    import sympy
    return x.node.expr if isinstance(x, torch.SymInt) else sympy.Integer(int(x))


# ATen ops whose device-specific fused kernels we turn back into their reference decomposition, so
# that one spelling matches on every device (F.rms_norm is one fused op on CUDA, five ops on CPU).
# the function Dynamo records for a grad-mode change inside a graph (torch.optim's step, no_grad)
set_grad_enabled = torch._C._set_grad_enabled
# the grouped GEMM over row ranges (public as F.grouped_mm from torch 2.12, private before)
grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
# the FP8 GEMM with per-tensor or per-row dequantization scales (torch 2.11-2.13: private)
scaled_mm = torch._scaled_mm

# torch.compile's own entry into Dynamo; unlike torch.compile it keeps a backend's backend_ctx_ctor
dynamo_optimize = torch._dynamo.optimize


def capture_dynamic_output_shapes():
    """Dynamo traces ops with data-dependent output sizes (nonzero, torch.where(mask)) into the graph
    with unbacked sizes instead of breaking it (a backend's backend_ctx_ctor: entered around each call
    of the compiled function, tracing included)."""
    return torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)


def has_unbacked(value) -> bool:
    """A fake value (or a tuple of them) with a data-dependent (unbacked) size."""
    if isinstance(value, (tuple, list)):
        return any(has_unbacked(v) for v in value)
    sizes = value.shape if isinstance(value, torch.Tensor) else (value,) if isinstance(value, torch.SymInt) else ()
    return any(isinstance(s, torch.SymInt) and _symbolic_shapes.has_free_unbacked_symbols(s) for s in sizes)


# --- Triton's launch internals (codegen/launch.py's FastKernel), checked for the versions listed ------
# A JITFunction launch binds its arguments, derives the specialization (dtypes, 16-byte alignment,
# integers equal to 1), builds a string key, looks the compiled kernel up, checks globals and then
# calls the compiled kernel's launcher: 36 us of host time on the H200 machine, of which the binder
# is 7 and the launcher 8 (benchmarks/host_overhead.py). FastKernel keeps the binder (Triton's own
# specialization rules) and the launcher and skips the rest.
TRITON_FAST_LAUNCH = tuple(int(p) for p in triton.__version__.split(".")[:2]) in {(3, 6)}


def triton_binder(fn, device: int):
    """The function binding a JITFunction's call arguments on `device`: -> (bound arguments in
    signature order, specialization list, remaining options)."""
    return fn.device_caches[device][4]


def triton_launch_hooked() -> bool:
    """A launch hook is set (a profiler): launches take Triton's own path, which calls it."""
    rt = triton.knobs.runtime  # a hook is a HookChain (3.6: empty unless one was added), or None, or a function
    return any(bool(getattr(h, "calls", h)) for h in (rt.launch_enter_hook, rt.launch_exit_hook))


def _raw_stream():
    try:  # what Triton's own launch passes (triton/backends/driver.py does the same)
        from torch._C import _cuda_getCurrentRawStream
        return _cuda_getCurrentRawStream
    except ImportError:  # a CPU-only build of torch
        return lambda device: torch.cuda.current_stream(device).cuda_stream


cuda_raw_stream = _raw_stream()  # device index -> the handle of its current CUDA stream


def triton_ready(compiled):
    """The CompiledKernel a JITFunction launch returned (waiting for an asynchronous compile)."""
    return compiled.result() if hasattr(compiled, "result") else compiled


def triton_launch(compiled, grid: tuple, stream: int, args) -> None:
    """Launch a CompiledKernel with every argument of its signature (constexprs included)."""
    run = compiled.run  # loads the binary on first use
    run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream, compiled.function,
        compiled.packed_metadata, None, None, None, *args)


def carry_dynamo_input_marks(src, dst) -> bool:
    """Copy Dynamo's marks of the graph inputs (each placeholder's source; parameters and buffers are
    static inputs) from the graph Dynamo handed the backend to the ATen graph it hands on. AOTAutograd
    reads them (frontend_utils: dynamo_compile_id, _param_name_to_source, node._dynamo_source,
    meta["tensor_dict"]["_dynamo_static_input_type"]) to tell CUDA graphs which inputs keep their
    address; without them every parameter is copied into the graph's buffers at each replay.
    The ATen trace holds tensor constants (`torch.tensor([...])` in the model) as buffers, which
    AOTAutograd lifts as inputs and looks up by name: each gets a constant source, as Dynamo gives
    its own constants. False (nothing copied) where the inputs do not correspond one to one."""
    if "dynamo_compile_id" not in src.meta:
        return False
    ours = list(src.graph.find_nodes(op="placeholder"))
    theirs = list(dst.graph.find_nodes(op="placeholder"))
    if len(ours) != len(theirs) or not all(hasattr(n, "_dynamo_source") for n in ours) or \
            any(True for _ in dst.named_parameters()):
        return False
    dst.meta["dynamo_compile_id"] = src.meta["dynamo_compile_id"]
    dst._param_name_to_source = {name: _ConstantSource(f"{__name__}.{type(dst).__name__}.{name}")
                                 for name, _ in dst.named_buffers(remove_duplicate=False)}
    for a, b in zip(ours, theirs):
        b._dynamo_source = a._dynamo_source
        if "tensor_dict" in a.meta:
            b.meta["tensor_dict"] = a.meta["tensor_dict"]
    return True


_DECOMPOSE = [torch.ops.aten._fused_rms_norm.default]
CANONICAL_DECOMPOSITIONS = get_decompositions(_DECOMPOSE)

__all__ = [
    "CANONICAL_DECOMPOSITIONS",
    "CheckpointPolicy",
    "CustomGraphPass",
    "FakeTensor",
    "FakeTensorMode",
    "HigherOrderOperator",
    "OpOverload",
    "RECOMPUTE_META",
    "aot_eager",
    "capture_dynamic_output_shapes",
    "carry_dynamo_input_marks",
    "compile_fx",
    "cuda_raw_stream",
    "detect_fake_mode",
    "dynamo_optimize",
    "get_hash_for_files",
    "grouped_mm",
    "has_unbacked",
    "inductor_config",
    "scaled_mm",
    "set_grad_enabled",
    "size_hint",
    "sym_expr",
    "tracing",
    "triton_binder",
    "triton_launch",
    "triton_launch_hooked",
    "triton_ready",
]
