"""Launch helpers shared by every kernel family: where we run, how big a tile, how many programs.

Under Triton's CPU interpreter (TRITON_INTERPRET=1) every program instance costs milliseconds, so tiles
are larger and persistent grids smaller there; on a GPU the tile sizes follow the usual rules for
memory-bound row kernels (one row of up to 8K elements per program, 4-16 warps).
"""
import functools
import hashlib
import importlib.util
import os
import tempfile

import torch
import triton

from fusion_compiler import _compat

MAX_ROW = 65536  # widest row a row-kernel keeps in registers
POISON = False  # tests set this: outputs start as NaN (or -1), so an element a kernel misses shows


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids (triton.cdiv is a constexpr function in Triton 3.6: several us a
    call from the host)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), for tile sizes (as triton.next_power_of_2)."""
    return 1 << (n - 1).bit_length()


def alloc(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output buffer (uninitialized, or poisoned under tests)."""
    if not POISON:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.full(shape, float("nan") if dtype.is_floating_point else -1, dtype=dtype, device=device)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def can_launch(device: torch.device) -> str | None:
    """None when Triton kernels can run on `device`, else the reason they cannot."""
    if device.type == "cuda":
        return None
    if device.type == "cpu" and interpreting():
        return None
    if device.type == "cpu":
        return "device cpu: Triton kernels need CUDA (or TRITON_INTERPRET=1 for the interpreter)"
    return f"device {device.type}: no Triton backend"


def row_tile(n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for a kernel that keeps whole rows of n_cols in registers."""
    return _row_tile(n_cols, interpreting())


@functools.lru_cache(maxsize=None)
def _row_tile(n_cols: int, interpreter: bool) -> tuple[int, int, int]:
    block_n = next_pow2(max(n_cols, 1))
    target = 16384 if interpreter else 4096
    block_m = max(1, min(64, target // block_n))
    num_warps = 4 if block_n * block_m <= 2048 else 8 if block_n * block_m <= 8192 else 16
    return block_m, block_n, num_warps


def bwd_row_tile(n_cols: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, programs per SM) for the persistent backward row kernels.

    Measured on the H200 (benchmarks/tune_tiles.py, 32768 rows, bf16): 8K-16K elements per loop
    iteration and 1-2 programs per SM reach ~4.0 TB/s; one row per iteration stalled at ~3.3 TB/s.
    """
    return _bwd_row_tile(n_cols, interpreting())


@functools.lru_cache(maxsize=None)
def _bwd_row_tile(n_cols: int, interpreter: bool) -> tuple[int, int, int, int]:
    block_n = next_pow2(max(n_cols, 1))
    target = 16384 if interpreter or block_n > 2048 else 8192
    block_m = max(1, min(64, target // block_n))
    num_warps = 4 if block_n <= 2048 else 16
    return block_m, block_n, num_warps, (2 if block_n <= 2048 else 1)


_SMS: dict = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere: the interpreter's default tile)."""
    if device.type != "cuda":
        return 1
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def persistent_programs(n_blocks: int, device: torch.device, per_sm: int = 2) -> int:
    """Programs for a persistent grid that loops over n_blocks blocks (one partial result each)."""
    if device.type != "cuda":
        return max(1, min(n_blocks, 4))
    return max(1, min(n_blocks, per_sm * sm_count(device)))


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """View t as [rows, last dim] with a unit column stride (copies only when it must)."""
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


_DIR = os.path.join(tempfile.gettempdir(), f"fusion_compiler_kernels_{os.getuid()}")


def load_kernel(source: str, prefix: str, name: str):
    """The kernel `name` (a FastKernel on a GPU) of a generated Triton source (written to a file
    named by its hash, so that Triton, which reads a jit function's source from its file, can compile it)."""
    module_name = f"{prefix}_" + hashlib.sha1(source.encode()).hexdigest()[:20]
    os.makedirs(_DIR, exist_ok=True)
    path = os.path.join(_DIR, module_name + ".py")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return fast_launch(getattr(module, name))


class FastKernel:
    """A @triton.jit kernel whose repeated launches skip Triton's per-call key building and lookup.

    `kernel[grid](*args, **kwargs)` binds the arguments with Triton's own binder (its specialization
    rules: dtypes, 16-byte alignment, integers equal to 1, constexprs), looks the compiled kernel up
    by that specialization, and calls its launcher. The first launch of a specialization, and every
    launch while a profiler's launch hook is set, goes through Triton's own path. Every other
    attribute is the JITFunction's.
    """

    def __init__(self, fn):
        self.fn = fn
        self.compiled: dict = {}

    def __getattr__(self, name):
        return getattr(self.fn, name)

    def __getitem__(self, grid):
        return functools.partial(self.launch, grid)

    def launch(self, grid, *args, **kwargs):
        device = torch.cuda.current_device()
        bound, specialization, options = _compat.triton_binder(self.fn, device)(*args, **kwargs)
        key = (device, tuple(specialization), tuple(options.items()))
        compiled = self.compiled.get(key)
        if compiled is None or _compat.triton_launch_hooked():
            self.compiled[key] = _compat.triton_ready(self.fn[grid](*args, **kwargs))
            return
        _compat.triton_launch(compiled, grid, _compat.cuda_raw_stream(device), bound.values())


def fast_launch(fn):
    """Decorator above @triton.jit: a FastKernel where Triton compiles for a GPU and its launch
    internals are the ones _compat checks; the kernel unchanged elsewhere (the interpreter) and in
    Triton's debug mode (TRITON_DEBUG: its checks are compiled into the kernels Triton's path picks)."""
    if _compat.TRITON_FAST_LAUNCH and isinstance(fn, triton.runtime.jit.JITFunction) and \
            not triton.knobs.runtime.debug:
        return FastKernel(fn)
    return fn
