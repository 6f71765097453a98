"""Multi-tensor elementwise updates: one kernel launch applies one lane program to many tensors.

A lane program (Program) is the per-element update of one tensor and its companions (a parameter, its
gradient, its optimizer state): tensor slots read or written, per-lane scalars (a bias correction, a
step size), constants, and a list of elementwise steps. The generated kernel reads the addresses of
each lane's tensors from a pointer table and maps its program id to (lane, first element) through a
block table, so tensors of any mixed sizes (empty ones too) share one launch:

    pid -> lane = block_lane[pid], offsets = block_start[pid] + arange(BLOCK)
    load every slot the program reads (upcast to fp32), evaluate the steps, store the written slots

Each step is computed in fp32 and rounded to its own dtype as eager PyTorch rounds each op's result
(a bf16 step is rounded to the nearest bf16, ties to even, before the next step reads it), with IEEE-rounded division and
square root (`div_rn`, `sqrt_rn`), so fp32 results agree with eager to the last bit or two.

`multi_tensor_sum_squares` is the first pass of a global-norm gradient clip: each lane's sum of
squares in one launch (per-block partial sums, then a per-lane sum: deterministic, no atomics).
"""
import ast
import dataclasses
import hashlib
import importlib.util
import os
import tempfile

import torch
import triton
import triton.language as tl

from .launch import interpreting

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "bool": torch.bool}
_TL = {"float32": "tl.float32", "bfloat16": "tl.bfloat16", "float16": "tl.float16"}


@dataclasses.dataclass(frozen=True)
class Program:
    """One lane's update. A reference is ("r", j) read-only slot j, ("w", j) the old value of written
    slot j, ("s", j) scalar j, ("v", k) the result of step k, or ("c", x) the constant x.
    steps: (op, (refs...), dtype name); stores: (written slot j, ref) pairs."""
    reads: tuple
    writes: tuple
    n_scalars: int
    steps: tuple
    stores: tuple

    def text(self) -> str:
        return repr(dataclasses.astuple(self))

    @staticmethod
    def parse(text: str) -> "Program":
        return Program(*ast.literal_eval(text))


# op -> Triton expression of its (already formatted) arguments
_OPS = {
    "add": lambda a, b: f"{a} + {b}",
    "sub": lambda a, b: f"{a} - {b}",
    "mul": lambda a, b: f"{a} * {b}",
    "div": lambda a, b: f"tl.math.div_rn({a}, {b})",
    "neg": lambda a: f"-{a}",
    "abs": lambda a: f"tl.abs({a})",
    "sqrt": lambda a: f"tl.math.sqrt_rn({a})",
    "rsqrt": lambda a: f"tl.math.div_rn(1.0, tl.math.sqrt_rn({a}))",
    "reciprocal": lambda a: f"tl.math.div_rn(1.0, {a})",
    "exp": lambda a: f"tl.exp({a})",
    "log": lambda a: f"tl.log({a})",
    "sigmoid": lambda a: f"tl.sigmoid({a})",
    "tanh": lambda a: f"(2.0 * tl.sigmoid(2.0 * {a}) - 1.0)",
    "sign": lambda a: f"(({a} > 0).to(tl.float32) - ({a} < 0).to(tl.float32))",
    "maximum": lambda a, b: f"tl.maximum({a}, {b}, propagate_nan=tl.PropagateNan.ALL)",
    "minimum": lambda a, b: f"tl.minimum({a}, {b}, propagate_nan=tl.PropagateNan.ALL)",
    "fma": lambda a, b, c: f"{a} * {b} + {c}",
    # torch.lerp: a + w (b - a) for |w| < 0.5, else b - (b - a)(1 - w)
    "lerp": lambda a, b, w: (f"tl.where(tl.abs({w}) < 0.5, {a} + {w} * ({b} - {a}), "
                             f"{b} - ({b} - {a}) * (1.0 - {w}))"),
    "where": lambda c, a, b: f"tl.where({c}, {a}, {b})",
    "gt": lambda a, b: f"{a} > {b}",
    "lt": lambda a, b: f"{a} < {b}",
    "ge": lambda a, b: f"{a} >= {b}",
    "le": lambda a, b: f"{a} <= {b}",
    "eq": lambda a, b: f"{a} == {b}",
    "ne": lambda a, b: f"{a} != {b}",
    "cast": lambda a: f"{a}",
}
OPS = frozenset(_OPS)


# fp32 -> nearest bf16 (ties to even), kept in fp32: the bits, not a cast (Triton's interpreter
# truncates in its bf16 cast, which would move a weight-decayed parameter down by an ulp each step)
_ROUND_BF16 = """@triton.jit
def _round_bf16(x):
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))"""


def _ref(ref) -> str:
    kind, value = ref
    if kind == "c":
        return repr(float(value))
    return f"{kind}{value}"


def source(program: Program) -> str:
    """The Triton source of the program's kernel."""
    n_slots = len(program.reads) + len(program.writes)
    lines = [
        "import triton", "import triton.language as tl", "", "", _ROUND_BF16, "", "", "@triton.jit",
        "def multi_tensor_kernel(PTRS, BLOCK_LANE, BLOCK_START, NUMELS, SCALARS, n_lanes, BLOCK: tl.constexpr):",
        "    pid = tl.program_id(0)",
        "    lane = tl.load(BLOCK_LANE + pid)",
        "    offs = tl.load(BLOCK_START + pid) + tl.arange(0, BLOCK)",
        "    mask = offs < tl.load(NUMELS + lane)",
        f"    base = PTRS + lane * {n_slots}",
    ]
    used = {ref for _, refs, _ in program.steps for ref in refs} | {ref for _, ref in program.stores}
    slots = [("r", j, dt) for j, dt in enumerate(program.reads)] + [("w", j, dt) for j, dt in enumerate(program.writes)]
    for position, (kind, j, dt) in enumerate(slots):
        lines.append(f"    {kind}{j}_ptr = tl.load(base + {position}).to(tl.pointer_type({_TL[dt]}))")
        if (kind, j) in used:
            lines.append(f"    {kind}{j} = tl.load({kind}{j}_ptr + offs, mask=mask, other=0.0).to(tl.float32)")
    for j in range(program.n_scalars):
        if ("s", j) in used:
            lines.append(f"    s{j} = tl.load(SCALARS + {j} * n_lanes + lane)")
    for k, (op, refs, dt) in enumerate(program.steps):
        expr = _OPS[op](*[_ref(r) for r in refs])
        if dt == "bfloat16":  # eager rounds each op's result to its dtype
            expr = f"_round_bf16({expr})"
        elif dt == "float16":
            expr = f"({expr}).to(tl.float16).to(tl.float32)"
        lines.append(f"    v{k} = {expr}")
    for j, ref in program.stores:
        lines.append(f"    tl.store(w{j}_ptr + offs, ({_ref(ref)}).to({_TL[program.writes[j]]}), mask=mask)")
    return "\n".join(lines) + "\n"


_KERNELS: dict = {}
_DIR = os.path.join(tempfile.gettempdir(), f"fusion_compiler_kernels_{os.getuid()}")


def kernel(program: Program):
    """The compiled (jit) kernel of a program; its source is written to a file so Triton can read it."""
    text = program.text()
    if text not in _KERNELS:
        src = source(program)
        name = "mt_" + hashlib.sha1(src.encode()).hexdigest()[:20]
        os.makedirs(_DIR, exist_ok=True)
        path = os.path.join(_DIR, name + ".py")
        if not os.path.exists(path):
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write(src)
            os.replace(tmp, path)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _KERNELS[text] = module.multi_tensor_kernel
    return _KERNELS[text]


def block_size() -> tuple[int, int]:
    """(elements per program, warps): 2048 x 4 warps on a GPU; large blocks under the interpreter."""
    return (4096, 4) if interpreting() else (BLOCK, WARPS)


BLOCK, WARPS = 2048, 4  # benchmarks/bench_optimizer.py measures the alternatives

_TABLES: dict = {}


def _block_table(numels: tuple, block: int, device: torch.device):
    """(block -> lane, block -> first element, lane -> numel, lane -> first block (lanes + 1)) for
    these sizes, cached: the sizes of a compiled step do not change."""
    key = (numels, block, device)
    if key not in _TABLES:
        lanes, starts, first = [], [], [0]
        for lane, n in enumerate(numels):
            for start in range(0, n, block):
                lanes.append(lane)
                starts.append(start)
            first.append(len(lanes))
        _TABLES[key] = tuple(torch.tensor(values, dtype=dtype).to(device) for values, dtype in
                             ((lanes, torch.int32), (starts, torch.int64), (numels, torch.int64), (first, torch.int64)))
    return _TABLES[key]


_POINTERS: dict = {}


def _pointer_table(tensors: list, device: torch.device) -> torch.Tensor:
    """The int64 addresses of the lanes' tensors, lane-major, cached by the addresses (parameters and
    optimizer state keep theirs from step to step; gradients set to None by zero_grad get new ones)."""
    addresses = (device, *(t.data_ptr() for t in tensors))
    if addresses not in _POINTERS:
        if len(_POINTERS) >= 64:
            _POINTERS.clear()
        table = torch.tensor(addresses[1:], dtype=torch.int64)
        if device.type == "cuda":
            table = table.pin_memory().to(device, non_blocking=True)
        _POINTERS[addresses] = table
    return _POINTERS[addresses]


def apply(program: Program, reads: list, writes: list, scalars: torch.Tensor) -> None:
    """Run the program over every lane: reads/writes are lane-major lists (len(program.reads) /
    len(program.writes) tensors per lane, all contiguous, of one numel per lane); scalars is
    [n_scalars, lanes] fp32."""
    n_r, n_w = len(program.reads), len(program.writes)
    n_lanes = len(writes) // n_w
    lane_tensors = []
    for lane in range(n_lanes):
        lane_tensors += reads[lane * n_r:(lane + 1) * n_r] + writes[lane * n_w:(lane + 1) * n_w]
    numels = tuple(writes[lane * n_w].numel() for lane in range(n_lanes))
    if sum(numels) == 0:
        return
    device = writes[0].device
    block, warps = block_size()
    block_lane, block_start, numel_t, _ = _block_table(numels, block, device)
    pointers = _pointer_table(lane_tensors, device)
    kernel(program)[(block_lane.numel(),)](pointers, block_lane, block_start, numel_t, scalars, n_lanes,
                                           BLOCK=block, num_warps=warps)


def verify(program: Program, device: torch.device) -> None:
    """Compile the program's kernel and run it once on two small random lanes (raises on failure)."""
    lanes = [3, 1]
    reads = [torch.randn(n, device=device).to(DTYPES[dt]) for n in lanes for dt in program.reads]
    writes = [torch.randn(n, device=device).to(DTYPES[dt]) for n in lanes for dt in program.writes]
    apply(program, reads, writes, torch.rand(max(program.n_scalars, 1), len(lanes), device=device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@triton.jit
def _sum_squares_kernel(PTRS, BLOCK_LANE, BLOCK_START, NUMELS, PARTIAL, BLOCK: tl.constexpr, DTYPE: tl.constexpr):
    pid = tl.program_id(0)
    lane = tl.load(BLOCK_LANE + pid)
    offs = tl.load(BLOCK_START + pid) + tl.arange(0, BLOCK)
    mask = offs < tl.load(NUMELS + lane)
    x = tl.load(tl.load(PTRS + lane).to(tl.pointer_type(DTYPE)) + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(PARTIAL + pid, tl.sum(x * x, axis=0))


@triton.jit
def _lane_sum_kernel(PARTIAL, FIRST, OUT, MAX_BLOCKS: tl.constexpr):
    lane = tl.program_id(0)
    first = tl.load(FIRST + lane)
    count = tl.load(FIRST + lane + 1) - first
    acc = tl.zeros([MAX_BLOCKS], dtype=tl.float32)
    for start in range(0, count, MAX_BLOCKS):
        idx = start + tl.arange(0, MAX_BLOCKS)
        acc += tl.load(PARTIAL + first + idx, mask=idx < count, other=0.0)
    tl.store(OUT + lane, tl.sum(acc, axis=0))


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def sum_squares(tensors: list) -> torch.Tensor:
    """fp32 [len(tensors)]: each tensor's sum of squares (all of one dtype, contiguous), one pass."""
    device = tensors[0].device
    numels = tuple(t.numel() for t in tensors)
    out = torch.zeros(len(tensors), dtype=torch.float32, device=device)
    block, warps = block_size()
    block_lane, block_start, numel_t, first = _block_table(numels, block, device)
    n_blocks = block_lane.numel()
    if n_blocks == 0:
        return out
    partial = torch.empty(n_blocks, dtype=torch.float32, device=device)
    _sum_squares_kernel[(n_blocks,)](_pointer_table(tensors, device), block_lane, block_start, numel_t, partial,
                                     BLOCK=block, DTYPE=_TL_DTYPES[tensors[0].dtype], num_warps=warps)
    _lane_sum_kernel[(len(tensors),)](partial, first, out, MAX_BLOCKS=1024)
    return out
