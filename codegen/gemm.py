"""GEMM with a generated epilogue: C = A @ B, then a chain of elementwise ops (and optionally a
reduction over N) applied to the fp32 accumulator tile before anything is stored.

An Epilogue is the chain as data: steps of (op, refs) over the product ("z",), side tensors ("s", j)
(broadcast vectors, scalars or full tensors, read with their own strides; a broadcast dim has
stride 0), constants ("c", x) and earlier steps ("v", k), plus an optional reduction over the last
dim (sum, mean, amax, logsumexp). From it this module generates two Triton kernels:

forward   blocked, pipelined tl.dot GEMM (grouped tile order for L2 reuse; A and B read by pointers
          or TMA, optionally persistent: one program per SM over the tiles); then the steps on the
          accumulator, whole or on its two column halves in turn (`HALVES`); store y (or, with a reduction, per-tile partials over N that a second, tiny
          stage combines); in training also store the product z when the backward needs it
backward  per tile of the product: recompute the steps from z, take the upstream gradient (for a
          reduction: from the per-row gradient, e.g. g * exp(y - lse) for logsumexp), run the chain
          rule backwards through the steps (codegen/pointwise.py DERIVATIVES) and store dz plus, per
          side that needs a gradient, its partial already summed over the side's broadcast dims
          inside the tile
The two backward GEMMs (dA = dz B^T, dB = A^T dz) stay torch matmuls: cuBLAS under Inductor.

Tile configs are data (CONFIGS); `tune` times them once per shape on the GPU and keeps the winner
in a JSON file (tuning.py), which `forward` reads.
"""
import ast
import dataclasses
import functools
import re

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import tuning
from .launch import alloc, cdiv, fast_launch, interpreting, load_kernel, next_pow2, sm_count
from .pointwise import DERIVATIVES, ROUND_BF16, TRITON

REDUCTIONS = ("sum", "mean", "amax", "logsumexp")
_VALUE = re.compile(r"\b(z|[sv]\d+)\b")
_TL = {torch.float32: "tl.float32", torch.bfloat16: "tl.bfloat16", torch.float16: "tl.float16"}


@dataclasses.dataclass(frozen=True)
class Epilogue:
    n_sides: int
    steps: tuple  # ((op, (refs...)), ...); the last step's value is the result (the product if none)
    reduce: str = ""  # "" or one of REDUCTIONS, over the last dim
    keepdim: bool = False

    def __post_init__(self):
        if self.reduce and self.reduce not in REDUCTIONS:
            raise ValueError(f"reduce={self.reduce!r}: expected one of {REDUCTIONS}")
        unknown = sorted({op for op, _ in self.steps} - set(DERIVATIVES))
        if unknown:
            raise ValueError(f"epilogue ops {unknown} have no generated form")

    def text(self) -> str:
        return repr(dataclasses.astuple(self))

    @staticmethod
    @functools.lru_cache(maxsize=1024)
    def parse(text: str) -> "Epilogue":
        """The epilogue of `text` (cached: the op parses its argument at every call)."""
        n_sides, steps, reduce, keepdim = ast.literal_eval(text)
        return Epilogue(n_sides, tuple((op, tuple(refs)) for op, refs in steps), reduce, keepdim)

    def result(self) -> str:
        return f"v{len(self.steps) - 1}" if self.steps else "z"

    def backward_reads_product(self, side_needs=None) -> bool:
        """Does the backward need z (to recompute the steps or the reduction's weights), given
        which sides need a gradient (None: all)?"""
        if self.reduce in ("amax", "logsumexp"):
            return True
        return any(name == "z" or name.startswith("v") for name in _partial_names(self, _wanted(self, side_needs)))


def _name(ref) -> str:
    kind = ref[0]
    if kind == "c":
        return repr(float(ref[1]))
    return "z" if kind == "z" else f"{kind}{ref[1]}"


def _wanted(ep: Epilogue, side_needs) -> set:
    """The names whose gradient the backward computes: z, every step, the sides that need one."""
    needs = side_needs if side_needs is not None else [True] * ep.n_sides
    return {"z", *(f"v{k}" for k in range(len(ep.steps))), *(f"s{j}" for j, need in enumerate(needs) if need)}


def _partials(ep: Epilogue, wanted: set):
    """Per step: (k, refs, partial derivative expression of each argument), None for a constant
    or an argument whose gradient is not wanted."""
    for k, (op, refs) in enumerate(ep.steps):
        args = [_name(r) for r in refs]
        partials = DERIVATIVES[op](*args, f"v{k}")
        yield k, refs, tuple(p if r[0] != "c" and _name(r) in wanted else None for r, p in zip(refs, partials))


def _partial_names(ep: Epilogue, wanted: set) -> set:
    names = set()
    for _, _, partials in _partials(ep, wanted):
        for partial in partials:
            if partial is not None:
                names |= set(_tokens(partial))
    return names


def _tokens(expr: str) -> list:
    """The kernel values an expression reads: the product z, sides s<j>, steps v<k>."""
    return _VALUE.findall(expr)


def _cast(expr: str, dtype: torch.dtype) -> str:
    """expr (fp32) as dtype; bf16 rounded to nearest-even on the bits under the interpreter, whose
    cast truncates (a truncated saved product would flip relu masks that eager's keeps)."""
    if dtype == torch.bfloat16 and interpreting():
        return f"_round_bf16({expr}).to(tl.bfloat16)"
    return f"({expr}).to({_TL[dtype]})"


def _header() -> list:
    return ["import triton", "import triton.language as tl", "", "", ROUND_BF16, "", "", "@triton.jit"]


def _steps(ep: Epilogue, indent: str) -> list:
    return [f"{indent}v{k} = {TRITON[op](*[_name(r) for r in refs])}" for k, (op, refs) in enumerate(ep.steps)]


def side_kinds(views) -> tuple:
    """Per [batch, M, N] side view: "s" one value per batch, "n" a row vector over N, "m" a column
    over M, "f" a full tile (a broadcast dim has stride 0); the kernel loads only what varies."""
    kinds = []
    for v in views:
        along_m, along_n = v.stride(1) != 0 and v.shape[1] > 1, v.stride(2) != 0 and v.shape[2] > 1
        kinds.append("f" if along_m and along_n else "m" if along_m else "n" if along_n else "s")
    return tuple(kinds)


def _side_loads(kinds: tuple, indent: str, needed=None) -> list:
    lines = []
    for j, kind in enumerate(kinds):
        if needed is not None and f"s{j}" not in needed:
            continue
        base = f"S{j} + batch * ss{j}_b"
        load = {"s": f"tl.load({base})",
                "n": f"tl.load({base} + rn * ss{j}_n, mask=mask_n, other=1.0)[None, :]",
                "m": f"tl.load({base} + rm * ss{j}_m, mask=mask_m, other=1.0)[:, None]",
                "f": f"tl.load({base} + rm[:, None] * ss{j}_m + rn[None, :] * ss{j}_n, mask=mask, other=1.0)"}[kind]
        lines.append(f"{indent}s{j} = {load}.to(tl.float32)")
    return lines


def _side_args(ep: Epilogue) -> tuple[str, str]:
    ptrs = "".join(f"S{j}, " for j in range(ep.n_sides))
    strides = "".join(f"ss{j}_b, ss{j}_m, ss{j}_n, " for j in range(ep.n_sides))
    return ptrs, strides


_MAIN_LOOP = {  # how the K loop reads A and B: pointers (any strides, batched) or TMA descriptors
    "pointer": [
        "    ram = tl.max_contiguous(tl.multiple_of(rm % M, BLOCK_M), BLOCK_M)",
        "    rbn = tl.max_contiguous(tl.multiple_of(rn % N, BLOCK_N), BLOCK_N)",
        "    rk = tl.arange(0, BLOCK_K)",
        "    a_ptrs = A + batch * sa_b + ram[:, None] * sa_m + rk[None, :] * sa_k",
        "    b_ptrs = B + batch * sb_b + rk[:, None] * sb_k + rbn[None, :] * sb_n",
        "    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)",
        "    for k in range(0, tl.cdiv(K, BLOCK_K)):",
        "        if EVEN_K:  # no K tail: unmasked loads",
        "            a = tl.load(a_ptrs)",
        "            b = tl.load(b_ptrs)",
        "        else:",
        "            a = tl.load(a_ptrs, mask=rk[None, :] < K - k * BLOCK_K, other=0.0)",
        "            b = tl.load(b_ptrs, mask=rk[:, None] < K - k * BLOCK_K, other=0.0)",
        "        if UPCAST:  # the interpreter's low-precision tl.dot is wrong: fp32 there",
        "            a = a.to(tl.float32)",
        "            b = b.to(tl.float32)",
        "        acc = tl.dot(a, b, acc, input_precision=PRECISION)",
        "        a_ptrs += BLOCK_K * sa_k",
        "        b_ptrs += BLOCK_K * sb_k",
    ],
    # one [M, K] product with unit-stride rows: tiles arrive by TMA (zero-filled past the edges);
    # B as stored, [K, N], or transposed ("tma_bt": w of F.linear, [N, K], read as w.T)
    "tma": [
        "    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)",
        "    for k in range(0, tl.cdiv(K, BLOCK_K)):",
        "        a = A.load([pid_m * BLOCK_M, k * BLOCK_K])",
        "        b = B.load([k * BLOCK_K, pid_n * BLOCK_N])",
        "        if UPCAST:  # the interpreter's low-precision tl.dot is wrong: fp32 there",
        "            a = a.to(tl.float32)",
        "            b = b.to(tl.float32)",
        "        acc = tl.dot(a, b, acc, input_precision=PRECISION)",
    ],
}
_MAIN_LOOP["tma_bt"] = [line.replace("B.load([k * BLOCK_K, pid_n * BLOCK_N])", "B.load([pid_n * BLOCK_N, k * BLOCK_K]).T")
                        for line in _MAIN_LOOP["tma"]]
# a TMA mode with this suffix launches one program per SM, each looping over tiles (`forward_source`)
PERSISTENT = "_persistent"
# and with this one (last) runs the epilogue on the tile's two column halves in turn: half the live
# registers for transcendental math, half the shared memory to stage a TMA store (H100, stop 25: a
# 128 x 256 persistent tile that stores its output does not fit whole)
HALVES = "_halves"


def _mode(loads: str) -> tuple[str, bool, bool]:
    """(the K loop's mode, persistent, halves) of a loads string such as "tma_bt_persistent_halves"."""
    halves = loads.endswith(HALVES)
    loads = loads.removesuffix(HALVES)
    return loads.removesuffix(PERSISTENT), loads.endswith(PERSISTENT), halves


def _epilogue(ep: Epilogue, y_dtype: torch.dtype, z_dtype: torch.dtype, kinds: tuple, tma_store: bool,
              acc: str = "acc", col: str = "pid_n * BLOCK_N", width: str = "BLOCK_N") -> list:
    """The steps on the accumulator tile `acc` (columns col .. col + width) and the store of y, or of
    the per-tile partials of the reduction."""
    body = [
        f"    rn = {col} + tl.arange(0, {width})",
        "    mask_n = rn < N",
        "    mask = mask_m[:, None] & mask_n[None, :]",
    ] + ([  # the product rounded to its dtype first, as eager's (and Inductor's) matmul output is
        f"    z = {_cast(acc, z_dtype)}.to(tl.float32)",
    ] if z_dtype != torch.float32 else [f"    z = {acc}"]) + [
        "    if STORE_Z:  # the product, for the backward (contiguous [batch, M, N])",
        f"        tl.store(Z + (batch * M + rm[:, None]) * N + rn[None, :], {_cast('z', z_dtype)}, mask=mask)",
    ]
    body += _side_loads(kinds, "    ")
    body += _steps(ep, "    ")
    y = ep.result()
    partial = "(batch * M + rm) * grid_n + pid_n"
    if not ep.reduce and tma_store:
        body.append(f"    Y.store([pid_m * BLOCK_M, {col}], {_cast(y, y_dtype)})")
    elif not ep.reduce:
        body.append(f"    tl.store(Y + batch * sy_b + rm[:, None] * sy_m + rn[None, :] * sy_n, {_cast(y, y_dtype)}, "
                     "mask=mask)")
    elif ep.reduce in ("sum", "mean"):
        body.append(f"    tl.store(P0 + {partial}, tl.sum(tl.where(mask, {y}, 0.0), 1), mask=mask_m)")
    elif ep.reduce == "amax":
        body.append(f"    tl.store(P0 + {partial}, tl.max(tl.where(mask, {y}, float('-inf')), 1), mask=mask_m)")
    else:  # logsumexp: the tile's max and its sum of exp(y - max), combined over tiles by `_finish`
        body += [f"    y = tl.where(mask, {y}, float('-inf'))",
                  "    top = tl.max(y, 1)",
                  "    safe = tl.where(top == float('-inf'), 0.0, top)",
                  f"    tl.store(P0 + {partial}, top, mask=mask_m)",
                  f"    tl.store(P1 + {partial}, tl.sum(tl.exp(y - safe[:, None]), 1), mask=mask_m)"]
    return body


def forward_source(ep: Epilogue, y_dtype: torch.dtype, z_dtype: torch.dtype, kinds: tuple,
                   loads: str = "pointer", tma_store: bool = False) -> str:
    """tma_store: Y is a TMA descriptor of the [M, N] output (clipped at the edges; its block one
    column half of the tile under HALVES), not a pointer. A reduction takes no HALVES."""
    mode, persistent, halves = _mode(loads)
    if halves and ep.reduce:
        raise ValueError("an epilogue that reduces over N runs on the whole tile (no HALVES)")
    ptrs, strides = _side_args(ep)
    lines = _header() + [
        "def gemm_epilogue_kernel(",
        f"    A, B, Y, Z, P0, P1, {ptrs}",
        "    M, N, K,",
        "    sa_b, sa_m, sa_k, sb_b, sb_k, sb_n, sy_b, sy_m, sy_n,",
        f"    {strides}",
        "    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,",
        "    STORE_Z: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr):",
        "    batch = tl.program_id(1)",
        "    grid_m = tl.cdiv(M, BLOCK_M)",
        "    grid_n = tl.cdiv(N, BLOCK_N)",
    ]
    body = [
        "    # grouped order: GROUP_M row tiles share each column tile of B while it is in L2",
        "    width = GROUP_M * grid_n",
        "    first_m = (pid // width) * GROUP_M",
        "    group_m = min(grid_m - first_m, GROUP_M)",
        "    pid_m = first_m + (pid % width) % group_m",
        "    pid_n = (pid % width) // group_m",
        "    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)",
        "    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)",
    ] + _MAIN_LOOP[mode] + ["    mask_m = rm < M"]
    if halves:  # [BLOCK_M, BLOCK_N] -> its left and right [BLOCK_M, BLOCK_N // 2] halves
        body.append("    acc_0, acc_1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))")
        for h in (0, 1):
            body += _epilogue(ep, y_dtype, z_dtype, kinds, tma_store, f"acc_{h}",
                              f"pid_n * BLOCK_N + {h} * (BLOCK_N // 2)", "BLOCK_N // 2")
    else:
        body += _epilogue(ep, y_dtype, z_dtype, kinds, tma_store)
    if persistent:  # one program per SM loops over the tiles; the K loops of
        # consecutive tiles flattened into one pipeline (the next tile's loads overlap this epilogue)
        lines.append("    for pid in tl.range(tl.program_id(0), grid_m * grid_n, tl.num_programs(0), flatten=True):")
        lines += ["    " + line for line in body]
    else:
        lines += ["    pid = tl.program_id(0)"] + body
    return "\n".join(lines) + "\n"


def _reverse(ep: Epilogue, wanted: set, indent: str) -> list:
    """Reverse-mode chain rule over the steps: g_<name> accumulates d result / d name."""
    lines, seen = [], set()
    last = ep.result()
    lines.append(f"{indent}g_{last} = up")
    seen.add(last)
    for k, refs, partials in reversed(list(_partials(ep, wanted))):
        if f"v{k}" not in seen:
            continue
        for ref, partial in zip(refs, partials):
            if partial is None:
                continue
            name = _name(ref)
            term = f"g_v{k} * ({partial})"
            lines.append(f"{indent}g_{name} = g_{name} + {term}" if name in seen else f"{indent}g_{name} = {term}")
            seen.add(name)
    for name in sorted(wanted - seen):
        if not name.startswith("v"):
            lines.append(f"{indent}g_{name} = up * 0.0")
    return lines


def backward_source(ep: Epilogue, z_dtype: torch.dtype, side_modes: tuple, kinds: tuple) -> str:
    """side_modes[j]: None (no gradient), or (reduce over M, reduce over N) for side j's partial."""
    ptrs, strides = _side_args(ep)
    q_ptrs = "".join(f"Q{j}, " for j in range(ep.n_sides))
    wanted = _wanted(ep, [mode is not None for mode in side_modes])
    reads_z = ep.backward_reads_product([mode is not None for mode in side_modes])
    needed = _partial_names(ep, wanted) | ({"z"} if reads_z else set())
    if reads_z:  # recomputing a step reads every side it uses
        needed |= {_name(r) for _, refs in ep.steps for r in refs if r[0] == "s"}
    lines = _header() + [
        "def gemm_epilogue_backward_kernel(",
        f"    G, Z, O, DZ, {ptrs}{q_ptrs}",
        "    M, N, sg_b, sg_m, sg_n,",
        f"    {strides}",
        "    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):",
        "    pid_m = tl.program_id(0)",
        "    pid_n = tl.program_id(1)",
        "    batch = tl.program_id(2)",
        "    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)",
        "    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)",
        "    mask_m = rm < M",
        "    mask_n = rn < N",
        "    mask = mask_m[:, None] & mask_n[None, :]",
    ]
    if reads_z:
        lines.append("    z = tl.load(Z + (batch * M + rm[:, None]) * N + rn[None, :], mask=mask, other=0.0).to(tl.float32)")
    lines += _side_loads(kinds, "    ", needed)
    if reads_z:
        lines += _steps(ep, "    ")
    if not ep.reduce:
        lines.append("    up = tl.load(G + batch * sg_b + rm[:, None] * sg_m + rn[None, :] * sg_n, mask=mask, "
                     "other=0.0).to(tl.float32)")
    else:
        lines.append("    g = tl.load(G + batch * M + rm, mask=mask_m, other=0.0).to(tl.float32)")
        if ep.reduce == "sum":
            lines.append("    up = g[:, None] + tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)")
        elif ep.reduce == "mean":
            lines.append("    up = g[:, None] / N + tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)")
        elif ep.reduce == "logsumexp":
            lines += ["    o = tl.load(O + batch * M + rm, mask=mask_m, other=0.0).to(tl.float32)",
                      f"    up = g[:, None] * tl.exp({ep.result()} - o[:, None])"]
        else:
            raise ValueError("amax has no generated backward (its gradient splits ties)")
    lines += _reverse(ep, wanted, "    ")
    lines.append(f"    tl.store(DZ + (batch * M + rm[:, None]) * N + rn[None, :], {_cast('g_z', z_dtype)}, mask=mask)")
    for j, mode in enumerate(side_modes):
        if mode is None:
            continue
        red_m, red_n = mode
        p = f"tl.where(mask, g_s{j}, 0.0)"
        if red_m and red_n:
            lines.append(f"    tl.store(Q{j} + (batch * tl.num_programs(0) + pid_m) * tl.num_programs(1) + pid_n, "
                         f"tl.sum(tl.sum({p}, 1), 0))")
        elif red_m:
            lines.append(f"    tl.store(Q{j} + (batch * tl.num_programs(0) + pid_m) * N + rn, tl.sum({p}, 0), mask=mask_n)")
        elif red_n:
            lines.append(f"    tl.store(Q{j} + (batch * M + rm) * tl.num_programs(1) + pid_n, tl.sum({p}, 1), mask=mask_m)")
        else:
            lines.append(f"    tl.store(Q{j} + (batch * M + rm[:, None]) * N + rn[None, :], {p}, mask=mask)")
    return "\n".join(lines) + "\n"


_KERNELS: dict = {}


def _kernel(key, make_source, name: str):
    if key not in _KERNELS:
        _KERNELS[key] = load_kernel(make_source(), "gemm", name)
    return _KERNELS[key]


# --- shapes ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Layout:
    """A [batch, M, K] @ [batch, K, N] view of the operands (b's batch stride 0 when it is 2-D; a's
    leading dims folded into M when that needs no copy), and each side as a [batch, M, N] view."""
    a: torch.Tensor
    b: torch.Tensor
    sides: tuple
    batch: int
    m: int
    n: int
    k: int


def _as_3d(t: torch.Tensor, batch: int, m: int, n: int):
    try:
        return t.view(batch, m, n)
    except (RuntimeError, ValueError):  # not viewable without a copy (meta tensors raise ValueError)
        return None


def layout_check(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None when a @ b is a product this kernel computes (2-D or 3-D operands; a 3-D b needs a
    3-D a with the same batch), else why not."""
    if a.dim() not in (2, 3) or b.dim() not in (2, 3):
        return f"operands of {a.dim()} and {b.dim()} dims (2-D or 3-D supported)"
    if b.dim() == 3 and (a.dim() != 3 or a.shape[0] != b.shape[0]):
        return f"batched b {list(b.shape)} with a {list(a.shape)}"
    if a.shape[-1] != b.shape[-2]:
        return f"inner sizes differ: {list(a.shape)} @ {list(b.shape)}"
    return None


def layout(a: torch.Tensor, b: torch.Tensor, sides: list, shape) -> Layout | None:
    """The views the kernels read (None when a side cannot be viewed as [batch, M, N])."""
    k, n = a.shape[-1], b.shape[-1]
    expanded = [s.expand(shape) for s in sides]
    if a.dim() == 3 and b.dim() == 2:  # fold a's batch into M when every view allows it
        folded = _as_3d(a, 1, a.shape[0] * a.shape[1], k)
        views = [_as_3d(s, 1, a.shape[0] * a.shape[1], n) for s in expanded]
        if folded is not None and all(v is not None for v in views):
            return Layout(folded, b.unsqueeze(0), tuple(views), 1, folded.shape[1], n, k)
    a3 = a if a.dim() == 3 else a.unsqueeze(0)
    b3 = b if b.dim() == 3 else b.unsqueeze(0).expand(a3.shape[0], k, n)
    batch, m = a3.shape[0], a3.shape[1]
    views = [_as_3d(s, batch, m, n) for s in expanded]
    if any(v is None for v in views):
        return None
    return Layout(a3, b3, tuple(views), batch, m, n, k)


def reduced_shape(ep: Epilogue, shape) -> list:
    if not ep.reduce:
        return list(shape)
    return list(shape[:-1]) + ([1] if ep.keepdim else [])


# --- configs -------------------------------------------------------------------------------------------
# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, stages, warps); Hopper-sized tiles first. Those whose pipeline
# would not fit shared memory for the dtype are skipped by `configs`.
CONFIGS = (
    (128, 256, 64, 8, 3, 8), (256, 128, 64, 8, 3, 8), (128, 128, 64, 8, 3, 4), (128, 128, 64, 8, 4, 8),
    (128, 128, 32, 8, 4, 4), (64, 128, 64, 8, 4, 4),
)
INTERPRETER_CONFIG = (32, 32, 32, 4, 1, 4)
SHARED_MEMORY = 220 * 1024
RETIME = 3  # the shape sweep's fastest configs that each further epilogue is timed at


def configs(element_size: int) -> list:
    if interpreting():
        return [INTERPRETER_CONFIG]
    return [c for c in CONFIGS if c[4] * (c[0] * c[2] + c[2] * c[1]) * element_size <= SHARED_MEMORY]


def default_config(lay: Layout, element_size: int) -> tuple:
    """Without a tuned entry: the largest tile that still gives every SM a tile or two (read by TMA
    where the operands allow it: `_plan`)."""
    options = configs(element_size)
    if interpreting():
        return options[0]
    sms = sm_count(lay.a.device)
    tiles = [(cdiv(lay.m, c[0]) * cdiv(lay.n, c[1]) * lay.batch, c) for c in options]
    for count, c in tiles:
        if count >= sms:
            return c
    return options[-1]


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's precision for fp32 operands: TF32 where torch's matmuls use it (allow_tf32)."""
    if dtype == torch.float32 and (interpreting() or not torch.backends.cuda.matmul.allow_tf32):
        return "ieee"
    return "tf32"


# --- launchers -----------------------------------------------------------------------------------------
def tma_loads(lay: Layout) -> str | None:
    """"tma" / "tma_bt" when A and B can be read through TMA descriptors (one unbatched product,
    unit-stride rows, 16-byte aligned rows and base), else None."""
    if lay.batch != 1 or not lay.m or not lay.n or not lay.k:
        return None
    a2, b2 = lay.a[0], lay.b[0]

    def rows_ok(t):
        return t.stride(-1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
    if not rows_ok(a2):
        return None
    return "tma" if rows_ok(b2) else "tma_bt" if rows_ok(b2.t()) else None


def load_modes(lay: Layout, reduce: str = "") -> tuple:
    """The ways the K loop may read this product's operands, and the epilogue take its tile (what the
    tile sweep times); an epilogue that reduces over N takes the whole tile."""
    tma = tma_loads(lay)
    if not tma:
        return ("pointer",)
    whole = ("pointer", tma, tma + PERSISTENT)
    return whole if reduce else whole + (tma + HALVES, tma + PERSISTENT + HALVES)


@dataclasses.dataclass(frozen=True)
class _Plan:
    config: tuple  # (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, stages, warps, loads)
    kernel: object
    grid: tuple
    tma_store: bool  # Y passed as a TMA descriptor


_PLANS: dict = {}


def _plan(ep: Epilogue, lay: Layout, out_dtype, save_product: bool, config) -> _Plan:
    """The launch of one signature (config, compiled kernel, grid), cached: a compiled step calls
    forward with the same shapes every time, and the tuning lookup formats keys."""
    tma = tma_loads(lay)
    key = (ep, lay.a.dtype, lay.a.device, lay.a.stride(), lay.b.stride(), tuple(v.stride() for v in lay.sides),
           lay.batch, lay.m, lay.n, lay.k, out_dtype, save_product, config, tma, tuning.version())
    plan = _PLANS.get(key)
    if plan is None:
        config = config or tuning.lookup(tuning_key(ep, lay, save_product)) or \
            tuning.lookup(tuning_key(ep, lay, save_product, sweep=True)) or default_config(lay, lay.a.element_size())
        loads = config[6] if len(config) > 6 else "tma" if tma else "pointer"
        if loads != "pointer":  # a tuned TMA config on operands that do not allow it reads by pointers
            _, persistent, halves = _mode(loads)
            loads = tma + (PERSISTENT if persistent else "") + (HALVES if halves and not ep.reduce else "") \
                if tma else "pointer"
        config = (*config[:6], loads)
        kinds = side_kinds(lay.sides)
        # persistent: the output tile leaves by TMA too (asynchronously; rows of 16-byte multiples)
        tma_store = _mode(loads)[1] and not ep.reduce and (lay.n * out_dtype.itemsize) % 16 == 0
        kernel = _kernel(("fwd", ep, out_dtype, lay.a.dtype, kinds, loads, tma_store),
                         lambda: forward_source(ep, out_dtype, lay.a.dtype, kinds, loads, tma_store),
                         "gemm_epilogue_kernel")
        grid = (cdiv(lay.m, config[0]) * cdiv(lay.n, config[1]), lay.batch)
        if _mode(loads)[1]:
            grid = (min(grid[0], sm_count(lay.a.device)), 1)
        plan = _PLANS[key] = _Plan(config, kernel, grid, tma_store)
    return plan


def _operands(lay: Layout, loads: str, bm: int, bn: int, bk: int) -> tuple:
    """A and B as the kernel reads them: the [batch, ., .] views, or TMA descriptors of their tiles."""
    if loads == "pointer":
        return lay.a, lay.b
    a2, b2 = lay.a[0], lay.b[0]
    if loads.startswith("tma_bt"):
        return TensorDescriptor.from_tensor(a2, [bm, bk]), TensorDescriptor.from_tensor(b2.t(), [bn, bk])
    return TensorDescriptor.from_tensor(a2, [bm, bk]), TensorDescriptor.from_tensor(b2, [bk, bn])


def forward(ep: Epilogue, a, b, sides: list, shape, out_dtype: torch.dtype, save_product: bool, config=None):
    """(y, z): y = epilogue(a @ b) in `shape` (reduced over its last dim if the epilogue reduces),
    z = the product in `shape` when save_product (else an empty tensor). config: a tile config
    (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, stages, warps); None: the tuned one, else a default."""
    lay = layout(a, b, sides, shape)
    if lay is None:
        raise ValueError(f"a side input cannot be read as [batch, M, N] for shape {list(shape)}")
    plan = _plan(ep, lay, out_dtype, save_product, config)
    bm, bn, bk, group, stages, warps, loads = plan.config
    grid_n = cdiv(lay.n, bn)
    dev = a.device
    y3 = alloc((lay.batch, lay.m, lay.n) if not ep.reduce else (0,), out_dtype, dev)
    z3 = alloc((lay.batch, lay.m, lay.n) if save_product else (0,), a.dtype, dev)
    parts = ((lay.batch, lay.m, grid_n) if ep.reduce else (0,))
    p0 = alloc(parts, torch.float32, dev)
    p1 = alloc(parts if ep.reduce == "logsumexp" else (0,), torch.float32, dev)
    if lay.m and lay.n:
        side_strides = [s for v in lay.sides for s in v.stride()]
        y_strides = y3.stride() if not ep.reduce else (0, 0, 0)
        a_in, b_in = _operands(lay, loads, bm, bn, bk)
        y_in = TensorDescriptor.from_tensor(y3[0], [bm, bn // 2 if _mode(loads)[2] else bn]) if plan.tma_store else y3
        plan.kernel[plan.grid](a_in, b_in, y_in, z3, p0, p1, *lay.sides, lay.m, lay.n, lay.k,
                               *lay.a.stride(), *lay.b.stride(), *y_strides, *side_strides,
                               BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, STORE_Z=save_product,
                               UPCAST=interpreting(), PRECISION=_precision(a.dtype), EVEN_K=lay.k % bk == 0,
                               num_stages=stages, num_warps=warps)
    y = y3.view(shape) if not ep.reduce else _finish(ep, p0, p1, lay.n).to(out_dtype).view(reduced_shape(ep, shape))
    z = z3.view(shape) if save_product else z3
    return y, z


_FINISH = {"sum": 0, "mean": 1, "amax": 2, "logsumexp": 3}


@fast_launch
@triton.jit
def _finish_kernel(P0, P1, Y, rows, tiles, n, REDUCE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr):
    """Y[r] = the reduction of row r's per-tile partials P0 (and P1 for logsumexp), [rows, tiles]."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = r < rows
    if REDUCE == 2 or REDUCE == 3:
        acc = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    else:
        acc = tl.zeros((BLOCK_R,), tl.float32)
    for t0 in range(0, tiles, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        mask = mask_r[:, None] & (t[None, :] < tiles)
        if REDUCE == 2 or REDUCE == 3:
            acc = tl.maximum(acc, tl.max(tl.load(P0 + r[:, None] * tiles + t[None, :], mask=mask,
                                                 other=float("-inf")), 1))
        else:
            acc += tl.sum(tl.load(P0 + r[:, None] * tiles + t[None, :], mask=mask, other=0.0), 1)
    if REDUCE == 1:
        acc = acc / n
    if REDUCE == 3:  # sum over tiles of p1 * exp(p0 - max), around a finite max
        safe = tl.where(tl.abs(acc) == float("inf"), 0.0, acc)
        total = tl.zeros((BLOCK_R,), tl.float32)
        for t0 in range(0, tiles, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            mask = mask_r[:, None] & (t[None, :] < tiles)
            p0 = tl.load(P0 + r[:, None] * tiles + t[None, :], mask=mask, other=float("-inf"))
            p1 = tl.load(P1 + r[:, None] * tiles + t[None, :], mask=mask, other=0.0)
            total += tl.sum(tl.where(mask, p1 * tl.exp(p0 - safe[:, None]), 0.0), 1)
        acc = safe + tl.log(total)
    tl.store(Y + r, acc, mask=mask_r)


def _finish(ep: Epilogue, p0: torch.Tensor, p1: torch.Tensor, n: int) -> torch.Tensor:
    """The second stage of a reduction: combine the per-tile partials over N ([batch, M, tiles]) in
    one launch (fp32 [batch, M])."""
    batch, m, tiles = p0.shape
    y = alloc((batch, m), torch.float32, p0.device)
    block_t = min(next_pow2(tiles), 64)
    block_r = max(1, 4096 // block_t)
    if y.numel():
        _finish_kernel[(cdiv(batch * m, block_r),)](p0, p1, y, batch * m, tiles, n, REDUCE=_FINISH[ep.reduce],
                                                    BLOCK_R=block_r, BLOCK_T=block_t)
    return y


def broadcast_dims(side_shape, shape, lay_shape) -> tuple[bool, bool, bool]:
    """Which dims of the [batch, M, N] view a side is broadcast over (its gradient sums over them)."""
    view = _as_3d(torch.empty(side_shape, device="meta").expand(shape), *lay_shape)
    return tuple(st == 0 and size > 1 for st, size in zip(view.stride(), lay_shape))


BACKWARD_TILE = (64, 64, 4)
INTERPRETER_BACKWARD_TILE = (32, 32, 4)


@dataclasses.dataclass(frozen=True)
class _BackwardPlan:
    batch: int
    m: int
    n: int
    modes: tuple  # per side: None (no gradient) or (sum over M, sum over N) in the tile
    batch_sums: tuple  # per side: is its gradient summed over the batch too
    kernel: object


_BACKWARD_PLANS: dict = {}


def _backward_plan(ep: Epilogue, sides: list, shape, side_needs, product_dtype, a_shape, b_shape) -> _BackwardPlan:
    """The backward launch of one signature, cached like the forward's (`_plan`)."""
    key = (ep, tuple(shape), tuple(a_shape), tuple(b_shape), tuple((tuple(s.shape), s.stride()) for s in sides),
           tuple(side_needs), product_dtype)
    plan = _BACKWARD_PLANS.get(key)
    if plan is None:
        lay = layout(torch.empty(a_shape, device="meta"), torch.empty(b_shape, device="meta"), sides, shape)
        dims = [broadcast_dims(s.shape, shape, (lay.batch, lay.m, lay.n)) if need else None
                for s, need in zip(sides, side_needs)]
        modes = tuple(None if d is None else d[1:] for d in dims)
        kinds = side_kinds(lay.sides)
        kernel = _kernel(("bwd", ep, product_dtype, modes, kinds),
                         lambda: backward_source(ep, product_dtype, modes, kinds), "gemm_epilogue_backward_kernel")
        plan = _BACKWARD_PLANS[key] = _BackwardPlan(lay.batch, lay.m, lay.n, modes,
                                                    tuple(d is not None and d[0] for d in dims), kernel)
    return plan


def backward(ep: Epilogue, grad, product, out, sides: list, shape, side_needs: list, product_dtype: torch.dtype,
             a_shape, b_shape, tile=None):
    """(dz in `shape`, [d side j or None]): the epilogue's backward from the upstream gradient
    (the reduced gradient when the epilogue reduces), the saved product and, for logsumexp, its
    output. tile: (BLOCK_M, BLOCK_N, warps), default BACKWARD_TILE."""
    dev = grad.device
    plan = _backward_plan(ep, sides, shape, side_needs, product_dtype, a_shape, b_shape)
    batch, m, n = plan.batch, plan.m, plan.n
    views = [_as_3d(s.expand(shape), batch, m, n) for s in sides]
    bm, bn, warps = tile or (INTERPRETER_BACKWARD_TILE if interpreting() else BACKWARD_TILE)
    tm, tn = cdiv(m, bm), cdiv(n, bn)
    partials = [alloc((0,), torch.float32, dev) if mode is None else
                alloc((batch, tm if mode[0] else m, tn if mode[1] else n), torch.float32, dev) for mode in plan.modes]
    dz = alloc((batch, m, n), product_dtype, dev)
    if ep.reduce:
        g3 = grad.reshape(batch, m).contiguous()
        g_strides = (0, 0, 0)
    else:
        g3 = grad.view(batch, m, n) if grad.is_contiguous() else grad.reshape(batch, m, n)
        g_strides = g3.stride()
    o = out.reshape(batch, m).contiguous() if ep.reduce == "logsumexp" else out
    if m and n:
        side_strides = [st for v in views for st in v.stride()]
        plan.kernel[(tm, tn, batch)](g3, product, o, dz, *views, *partials, m, n, *g_strides, *side_strides,
                                     BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
    grads = []
    for s, mode, red_b, part in zip(sides, plan.modes, plan.batch_sums, partials):
        if mode is None:
            grads.append(None)
            continue
        dims = [d for d, red in zip((0, 1, 2), (red_b, *mode)) if red]
        total = part.sum(dims, keepdim=True) if dims else part
        if not m or not n:
            total = torch.zeros(1, device=dev).expand(s.shape)
        grads.append(total.reshape(s.shape).to(s.dtype))
    return dz.view(shape), grads


def tuning_key(ep: Epilogue, lay: Layout, save_product: bool, sweep: bool = False) -> str:
    """The cache key of one epilogue on a shape (its own time at its config) or, with `sweep`, of the
    shape's tile sweep: shared by every epilogue on that product that writes its [M, N] output, and
    apart for those that reduce over N (no output tile to stage: other tiles fit)."""
    device = torch.cuda.get_device_name(lay.a.device) if lay.a.device.type == "cuda" else lay.a.device.type
    what = ("sweep-reduce" if ep.reduce else "sweep") if sweep else ep.text()
    return (f"{device}|{what}|{lay.a.dtype}|{lay.batch}x{lay.m}x{lay.n}x{lay.k}|a{lay.a.stride()}|b{lay.b.stride()}"
            f"|z{int(save_product)}")


def _bench(fn) -> float:
    """Milliseconds per call, replayed from a CUDA graph (GPU time without Python's launch cost,
    the same for every side of a comparison)."""
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=20)
    except Exception:  # noqa: BLE001  (a call that cannot be captured is timed with launches)
        return triton.testing.do_bench(fn, warmup=5, rep=25)


def tune(ep: Epilogue, a, b, sides: list, shape, out_dtype: torch.dtype, save_product: bool) -> dict:
    """Time the product's tile configs once per shape (CUDA only; the sweep runs with this first
    epilogue and is shared, one for the epilogues that write the output, one for those that reduce
    over N), then this epilogue at the sweep's RETIME fastest configs, and cuBLAS on
    the bare product. An epilogue with transcendental math can want another tile than relu's (stop 22,
    16384 x 1024 -> 1024 bf16: tanh-GELU 0.0736 ms at relu's best tile, 0.0689 at the second).
    Returns the stored entry of the epilogue: {"config", "ms", "cublas_ms"}; `forward` launches with
    its config from then on."""
    lay = layout(a, b, sides, shape)
    key, sweep_key = tuning_key(ep, lay, save_product), tuning_key(ep, lay, save_product, sweep=True)
    known = tuning.entry(key)
    if known is not None:
        return known
    sweep = tuning.entry(sweep_key)
    if sweep is None:
        timed = []
        for config in [(*c, loads) for c in configs(a.element_size()) for loads in load_modes(lay, ep.reduce)]:
            try:
                timed.append((_bench(lambda: forward(ep, a, b, sides, shape, out_dtype, save_product, config)),
                              config))
            except Exception:  # noqa: BLE001  (a config that does not compile for this dtype is skipped)
                continue
        if not timed:
            raise RuntimeError("no GEMM tile config compiled for this shape")
        timed.sort(key=lambda t: t[0])
        sweep = {"config": list(timed[0][1]), "ms": timed[0][0], "ranked": [list(c) for _, c in timed[:RETIME]],
                 "cublas_ms": _bench(lambda: torch.matmul(a, b))}
        tuning.record(sweep_key, sweep)
    best, failure = None, None
    for config in map(tuple, sweep.get("ranked") or [sweep["config"]]):
        try:
            ms = _bench(lambda: forward(ep, a, b, sides, shape, out_dtype, save_product, config))
        except Exception as e:  # noqa: BLE001  (this epilogue may not compile at every tile)
            failure = e
            continue
        if best is None or ms < best[0]:
            best = (ms, config)
    if best is None:
        raise failure
    found = {"config": list(best[1]), "cublas_ms": sweep["cublas_ms"], "ms": best[0]}
    tuning.record(key, found)
    return found
