"""Launch helpers shared by every kernel family: where we run, how big a tile, how many programs.

Under Triton's CPU interpreter (TRITON_INTERPRET=1) every program instance costs milliseconds, so tiles
are larger and persistent grids smaller there; on a GPU the tile sizes follow the usual rules for
memory-bound row kernels (one row of up to 8K elements per program, 4-16 warps).
"""
import hashlib
import importlib.util
import os
import tempfile

import torch
import triton

MAX_ROW = 65536  # widest row a row-kernel keeps in registers
POISON = False  # tests set this: outputs start as NaN (or -1), so an element a kernel misses shows


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
    block_n = triton.next_power_of_2(max(n_cols, 1))
    target = 16384 if interpreting() else 4096
    block_m = max(1, min(64, target // block_n))
    num_warps = 4 if block_n * block_m <= 2048 else 8 if block_n * block_m <= 8192 else 16
    return block_m, block_n, num_warps


def bwd_row_tile(n_cols: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, programs per SM) for the persistent backward row kernels.

    Measured on the H200 (benchmarks/tune_tiles.py, 32768 rows, bf16): 8K-16K elements per loop
    iteration and 1-2 programs per SM reach ~4.0 TB/s; one row per iteration stalled at ~3.3 TB/s.
    """
    block_n = triton.next_power_of_2(max(n_cols, 1))
    target = 16384 if interpreting() or block_n > 2048 else 8192
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
    """The function `name` of a generated Triton source (written to a file named by its hash, so
    that Triton, which reads a jit function's source from its file, can compile it)."""
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
    return getattr(module, name)
