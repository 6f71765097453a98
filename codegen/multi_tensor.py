"""Multi-tensor elementwise updates: one kernel launch applies one lane program to many tensors.

A lane program (Program) is the per-element update of one tensor and its companions (a parameter, its
gradient, its optimizer state): tensor slots read or written, per-lane scalars (a bias correction, a
step size), constants, and a list of elementwise steps. The generated kernel addresses each slot as a
typed base pointer (one kernel argument per dtype) plus the tensor's element offset from it, read
from a table, and maps its program id to (lane, first element) through a block table, so tensors of
any mixed sizes (empty ones too) share one launch:

    pid -> lane = block_lane[pid], offsets = block_start[pid] + arange(BLOCK)
    load every slot the program reads (upcast to fp32), evaluate the steps, store the written slots

Each step is computed in fp32 and rounded to its own dtype as eager PyTorch rounds each op's result
(a bf16 step is rounded to the nearest bf16, ties to even, before the next step reads it), with
IEEE-rounded division and square root (`div_rn`, `sqrt_rn`), so fp32 results agree with eager to the
last bit or two.

`multi_tensor_sum_squares` is the first pass of a global-norm gradient clip: each lane's sum of
squares in one launch (per-block partial sums, then a per-lane sum: deterministic, no atomics).
"""
import ast
import dataclasses

import torch
import triton
import triton.language as tl

from .launch import fast_launch, interpreting, load_kernel
from .pointwise import ARITHMETIC, ROUND_BF16, TRITON

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


OPS = frozenset(ARITHMETIC)




def _ref(ref) -> str:
    kind, value = ref
    if kind == "c":
        return repr(float(value))
    return f"{kind}{value}"


_SIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def _body(program: Program, used: set, mask: str, indent: str) -> list:
    """Loads, steps and stores of one block (mask: "" for a full block)."""
    load_mask = f", mask={mask}, other=0.0" if mask else ""
    store_mask = f", mask={mask}" if mask else ""
    lines = []
    for kind, dtypes in (("r", program.reads), ("w", program.writes)):
        for j in range(len(dtypes)):
            if (kind, j) in used:
                lines.append(f"{kind}{j} = tl.load(p_{kind}{j}{load_mask}).to(tl.float32)")
    for k, (op, refs, dt) in enumerate(program.steps):
        expr = TRITON[op](*[_ref(r) for r in refs])
        if dt == "bfloat16":  # eager rounds each op's result to its dtype
            expr = f"_round_bf16({expr})"
        elif dt == "float16":
            expr = f"({expr}).to(tl.float16).to(tl.float32)"
        lines.append(f"v{k} = {expr}")
    for j, ref in program.stores:
        lines.append(f"tl.store(p_w{j}, ({_ref(ref)}).to({_TL[program.writes[j]]}){store_mask})")
    return [indent + line for line in lines]


def source(program: Program) -> str:
    """The Triton source of the program's kernel. Each slot is addressed as BASE_<dtype> + its
    element offset from a table: the typed base pointers are kernel arguments, so with ALIGNED
    (every base 16-byte aligned, every offset a multiple of 16 bytes) Triton can vectorize the loads
    and stores; full blocks run without a mask, the lane's last block with one."""
    slots = [("r", j, dt) for j, dt in enumerate(program.reads)] + [("w", j, dt) for j, dt in enumerate(program.writes)]
    bases = ", ".join(f"BASE_{dt}" for dt in sorted({dt for _, _, dt in slots}))
    lines = [
        "import triton", "import triton.language as tl", "", "", ROUND_BF16, "", "", "@triton.jit",
        f"def multi_tensor_kernel({bases}, OFFSETS, BLOCK_LANE, BLOCK_START, NUMELS, SCALARS, n_lanes,",
        "                        BLOCK: tl.constexpr, ALIGNED: tl.constexpr):",
        "    pid = tl.program_id(0)",
        "    lane = tl.load(BLOCK_LANE + pid)",
        "    start = tl.multiple_of(tl.load(BLOCK_START + pid), BLOCK)",
        "    numel = tl.load(NUMELS + lane)",
        "    offs = start + tl.arange(0, BLOCK)",
    ]
    for position, (kind, j, dt) in enumerate(slots):
        lines += [f"    o_{kind}{j} = tl.load(OFFSETS + lane * {len(slots)} + {position})",
                  "    if ALIGNED:",
                  f"        o_{kind}{j} = tl.multiple_of(o_{kind}{j}, {16 // _SIZE[dt]})",
                  f"    p_{kind}{j} = BASE_{dt} + o_{kind}{j} + offs"]
    used = {ref for _, refs, _ in program.steps for ref in refs} | {ref for _, ref in program.stores}
    for j in range(program.n_scalars):
        if ("s", j) in used:
            lines.append(f"    s{j} = tl.load(SCALARS + {j} * n_lanes + lane)")
    lines.append("    if start + BLOCK <= numel:")
    lines += _body(program, used, "", " " * 8)
    lines += ["    else:", "        mask = offs < numel"]
    lines += _body(program, used, "mask", " " * 8)
    return "\n".join(lines) + "\n"


_KERNELS: dict = {}


def kernel(program: Program):
    """The compiled (jit) kernel of a program."""
    if program not in _KERNELS:
        _KERNELS[program] = load_kernel(source(program), "mt", "multi_tensor_kernel")
    return _KERNELS[program]


def block_size() -> tuple[int, int]:
    """(elements per program, warps): large blocks under the interpreter."""
    return (4096, 4) if interpreting() else (BLOCK, WARPS)


# H200 (benchmarks/RESULTS.md, optimizer runs 2-4): 256-1024 elements x 2-4 warps all reach
# 4.12-4.13 TB/s on AdamW; 2048 x 4: 3.9, 4096 x 8: 3.2; several blocks per program: 4.0
BLOCK, WARPS = 1024, 4
# the sum-of-squares pass: 8 chunks of 2048 a program, 4.49 TB/s alone on the H200 (one chunk of
# 4096 x 8 warps: 4.11; RESULTS.md, 2026-12-04 stop 19)
NORM_BLOCK, NORM_WARPS, NORM_PER = 2048, 8, 8

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


_OFFSETS: dict = {}


def _offset_table(tensors: list, device: torch.device):
    """(typed base tensors by dtype, int64 element offsets of the tensors from their dtype's base,
    ALIGNED) or None when a tensor is not a whole number of elements away from its base. Cached by
    the addresses (parameters and optimizer state keep theirs from step to step; gradients set to
    None by zero_grad get new ones); only addresses are kept, never tensors."""
    bases = {}
    for t in tensors:
        if t.numel() and t.dtype not in bases:
            bases[t.dtype] = t
    key = (device, *((t.data_ptr(), t.dtype, t.numel() == 0) for t in tensors))  # what the offsets depend on
    if key not in _OFFSETS:
        if len(_OFFSETS) >= 64:
            _OFFSETS.clear()
        base_addr = {dt: b.data_ptr() for dt, b in bases.items()}
        offsets, aligned = [], all(a % 16 == 0 for a in base_addr.values())
        for t in tensors:
            if not t.numel():
                offsets.append(0)
                continue
            delta = t.data_ptr() - base_addr[t.dtype]
            if delta % t.element_size():
                _OFFSETS[key] = None
                break
            offsets.append(delta // t.element_size())
            aligned = aligned and delta % 16 == 0
        else:
            table = torch.tensor(offsets, dtype=torch.int64)
            if device.type == "cuda":
                table = table.pin_memory().to(device, non_blocking=True)
            _OFFSETS[key] = (table, aligned)
    entry = _OFFSETS[key]
    return None if entry is None else (bases, *entry)


_TORCH_OPS = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "neg": torch.neg, "abs": torch.abs,
    "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "reciprocal": torch.reciprocal, "exp": torch.exp, "log": torch.log,
    "sigmoid": torch.sigmoid, "tanh": torch.tanh, "sign": torch.sign, "maximum": torch.maximum,
    "minimum": torch.minimum, "fma": lambda a, b, c: a * b + c, "lerp": torch.lerp, "where": torch.where,
    "gt": torch.gt, "lt": torch.lt, "ge": torch.ge, "le": torch.le, "eq": torch.eq, "ne": torch.ne,
    "cast": lambda a: a,
}


def apply_eager(program: Program, reads: list, writes: list, scalars: torch.Tensor) -> None:
    """The program with torch ops, lane by lane (tensors the kernel cannot address; a reference)."""
    n_r, n_w = len(program.reads), len(program.writes)
    for lane in range(len(writes) // n_w):
        env = {("r", j): t.float() for j, t in enumerate(reads[lane * n_r:(lane + 1) * n_r])}
        env.update({("w", j): t.float() for j, t in enumerate(writes[lane * n_w:(lane + 1) * n_w])})
        env.update({("s", j): scalars[j, lane] for j in range(program.n_scalars)})

        def val(ref):
            return torch.tensor(ref[1], dtype=torch.float32) if ref[0] == "c" else env[ref]
        for k, (op, refs, dt) in enumerate(program.steps):
            args = [val(r) for r in refs]
            if op == "lerp":
                args[2] = args[2].expand_as(args[0]) if args[2].dim() == 0 else args[2]
            result = _TORCH_OPS[op](*args)
            env[("v", k)] = result if dt in ("float32", "bool") else result.to(DTYPES[dt]).float()
        for j, ref in program.stores:
            writes[lane * n_w + j].copy_(val(ref))


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
    addressing = _offset_table(lane_tensors, device)
    if addressing is None:
        apply_eager(program, reads, writes, scalars)
        return
    bases, offsets, aligned = addressing
    block, warps = block_size()
    block_lane, block_start, numel_t, _ = _block_table(numels, block, device)
    typed = [bases[DTYPES[dt]] for dt in sorted({*program.reads, *program.writes})]
    kernel(program)[(block_lane.numel(),)](*typed, offsets, block_lane, block_start, numel_t, scalars, n_lanes,
                                           BLOCK=block, ALIGNED=aligned, num_warps=warps)


def verify(program: Program, device: torch.device) -> None:
    """Compile the program's kernel and run it once on two small random lanes (raises on failure;
    positive values: a second moment's square root stays real)."""
    lanes = [3, 1]
    reads = [torch.rand(n, device=device).to(DTYPES[dt]) for n in lanes for dt in program.reads]
    writes = [torch.rand(n, device=device).to(DTYPES[dt]) for n in lanes for dt in program.writes]
    apply(program, reads, writes, torch.rand(max(program.n_scalars, 1), len(lanes), device=device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@fast_launch
@triton.jit
def _sum_squares_kernel(BASE, OFFSETS, BLOCK_LANE, BLOCK_START, NUMELS, PARTIAL, BLOCK: tl.constexpr,
                        PER: tl.constexpr, ALIGNED: tl.constexpr, VEC: tl.constexpr):
    """One program: PER consecutive BLOCK-element chunks of one lane (its table block is BLOCK * PER)."""
    pid = tl.program_id(0)
    lane = tl.load(BLOCK_LANE + pid)
    start = tl.multiple_of(tl.load(BLOCK_START + pid), BLOCK)
    numel = tl.load(NUMELS + lane)
    offset = tl.load(OFFSETS + lane)
    if ALIGNED:
        offset = tl.multiple_of(offset, VEC)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if start + BLOCK * PER <= numel:
        for i in tl.static_range(PER):
            x = tl.load(BASE + offset + start + i * BLOCK + tl.arange(0, BLOCK)).to(tl.float32)
            acc += x * x
    else:
        for i in tl.static_range(PER):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(BASE + offset + offs, mask=offs < numel, other=0.0).to(tl.float32)
            acc += x * x
    tl.store(PARTIAL + pid, tl.sum(acc, axis=0))


@fast_launch
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


def sum_squares(tensors: list) -> torch.Tensor:
    """fp32 [len(tensors)]: each tensor's sum of squares (all of one dtype, contiguous), one pass."""
    device = tensors[0].device
    numels = tuple(t.numel() for t in tensors)
    out = torch.zeros(len(tensors), dtype=torch.float32, device=device)
    addressing = _offset_table(tensors, device)
    if sum(numels) == 0 or addressing is None:
        return out if sum(numels) == 0 else torch.stack([(t.float() ** 2).sum() for t in tensors])
    bases, offsets, aligned = addressing
    block, warps, per = (1024, 4, 2) if interpreting() else (NORM_BLOCK, NORM_WARPS, NORM_PER)
    block_lane, block_start, numel_t, first = _block_table(numels, block * per, device)
    n_blocks = block_lane.numel()
    partial = torch.empty(n_blocks, dtype=torch.float32, device=device)
    _sum_squares_kernel[(n_blocks,)](bases[tensors[0].dtype], offsets, block_lane, block_start, numel_t, partial,
                                     BLOCK=block, PER=per, ALIGNED=aligned, VEC=16 // tensors[0].element_size(),
                                     num_warps=warps)
    _lane_sum_kernel[(len(tensors),)](partial, first, out, MAX_BLOCKS=1024)
    return out
