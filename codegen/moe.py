"""Mixture-of-experts experts as grouped GEMMs over expert-sorted rows, forward and backward.

Notation: T tokens, k experts per token, S = T*k (token, slot) rows, E experts, D model width, F expert
width. Row s of the sorted order is the flat slot perm[s] = t*k + j; its token is t = perm[s] // k.
Expert e owns sorted rows [offsets[e], offsets[e+1]) (`route`: a sort and a searchsorted on the device,
no host sync). Weights are logical views (any strides, so fused, interleaved, separate or transposed
storage is read in place):
    w_gate, w_up [E, F, D] (gated experts; w_up is unused otherwise), w_down [E, D, F].

Forward, two kernels over row tiles that never cross an expert (`tiles`):
    _up_fwd     a = x[token] @ w_gate[e].T (and u = x[token] @ w_up[e].T), rows gathered in the kernel;
                stores the pre-activations (saved for the backward) and h = act(a) * u (or act(a))
    _down_fwd   y = h @ w_down[e].T, times the routing weight, stored at its slot: out = slots summed
Backward, for dout [T, D]:
    _down_bwd   g = dout[token] @ w_down[e]; d weight[s] = <g, h> (per column tile, summed after);
                dh = weight * g; the activation's derivative gives d pre-activations
    _up_bwd     dx at the slot = d_a @ w_gate[e] (+ d_u @ w_up[e]); dx = slots summed
    _weight_grad  per expert, K = its rows: dW_gate = d_a^T x[token], dW_up = d_u^T x[token],
                dW_down = (weight * dout[token])^T h
Slots are fp32 [S, D] summed over k in fp32 (deterministic; the order HF's reference sums in).
Activations and their derivatives come from codegen/glu.py.
"""
import dataclasses

import torch
import triton
import triton.language as tl

from .glu import ACTIVATIONS, act_and_grad
from .launch import alloc, as_rows, cdiv, fast_launch, interpreting

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, stages, warps) for the row-tile kernels; (BLOCK_P, BLOCK_Q,
# BLOCK_K, stages, warps) for the weight gradients. The interpreter's tiles are small: each program
# instance costs milliseconds there.
ROW_CONFIG = (128, 128, 64, 8, 3, 8)
GATED_CONFIG = (128, 64, 64, 8, 3, 8)  # two accumulators
WEIGHT_CONFIG = (128, 128, 64, 3, 8)
INTERPRETER_ROW_CONFIG = (16, 32, 32, 4, 1, 4)
INTERPRETER_WEIGHT_CONFIG = (32, 32, 16, 1, 4)


@dataclasses.dataclass(frozen=True)
class Routing:
    perm: torch.Tensor     # [S] int32: sorted row -> flat slot t*k + j
    token: torch.Tensor    # [S] int32: sorted row -> token
    weight: torch.Tensor   # [S] fp32: sorted row -> its routing weight
    slot_weight: torch.Tensor  # [S] fp32: the routing weights in slot order (t*k + j)
    inverse: torch.Tensor  # [S] int32: flat slot -> sorted row (perm's inverse)
    offsets: torch.Tensor  # [E + 1] int32: expert e's sorted rows are [offsets[e], offsets[e + 1])
    top_k: int
    tile_tables: dict = dataclasses.field(default_factory=dict, compare=False)  # by BLOCK_M (`tiles`)


def route(index: torch.Tensor, weight: torch.Tensor, experts: int) -> Routing:
    """Sort the (token, slot) pairs by expert. Indices outside [0, experts) sort after every expert's
    rows and contribute nothing (as expert-parallel sentinels do in HF)."""
    flat = _sort_key(index.reshape(-1), experts)
    sorted_experts, perm = torch.sort(flat, stable=True)
    bounds = torch.arange(experts + 1, device=flat.device, dtype=sorted_experts.dtype)
    offsets = torch.searchsorted(sorted_experts, bounds).to(torch.int32)
    return rebuild(perm.to(torch.int32), offsets, weight)


def _sort_key(flat: torch.Tensor, experts: int) -> torch.Tensor:
    """The expert ids in the narrowest integer type that holds 0 .. experts: torch's radix sort makes
    one pass per byte of the key (8 for the int64 ids topk returns, 1 for int8). Every id outside
    [0, experts), negative ones included, becomes `experts`: its rows sort after the last expert's, so
    expert 0's rows start at row 0 (grouped_mm's first group does) and all rows past offsets[-1] are
    no expert's."""
    outside = (flat < 0) | (flat > experts)
    for dtype in (torch.int8, torch.int16, torch.int32, torch.int64):
        if experts < torch.iinfo(dtype).max:
            return flat.to(dtype, copy=True).masked_fill_(outside, experts)


@fast_launch
@triton.jit
def _tables_kernel(PERM, W, TOKEN, WEIGHT, SLOT_WEIGHT, INVERSE, S, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """Per sorted row s, slot p = PERM[s]: TOKEN[s] = p // k, WEIGHT[s] = W[p], INVERSE[p] = s; and
    SLOT_WEIGHT = W, all weights in fp32."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < S
    slot = tl.load(PERM + rows, mask=mask, other=0)
    tl.store(TOKEN + rows, slot // TOP_K, mask=mask)
    tl.store(WEIGHT + rows, tl.load(W + slot, mask=mask, other=0.0).to(tl.float32), mask=mask)
    tl.store(INVERSE + slot, rows, mask=mask)
    tl.store(SLOT_WEIGHT + rows, tl.load(W + rows, mask=mask, other=0.0).to(tl.float32), mask=mask)


def rebuild(perm: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor) -> Routing:
    """The Routing of a sort already made (the backward gets perm and offsets from the forward): its
    per-row tables in one pass (`_tables_kernel`)."""
    top_k, rows = weight.shape[-1], perm.numel()
    token, inverse = (alloc((rows,), torch.int32, perm.device) for _ in range(2))
    sorted_weight, slot_weight = (alloc((rows,), torch.float32, perm.device) for _ in range(2))
    if rows:
        block = 1024
        _tables_kernel[(cdiv(rows, block),)](perm, weight.reshape(-1), token, sorted_weight, slot_weight, inverse,
                                             rows, TOP_K=top_k, BLOCK=block, num_warps=4)
    return Routing(perm, token, sorted_weight, slot_weight, inverse, offsets, top_k)


def tiles(routing: Routing, block_m: int) -> torch.Tensor:
    """[3, n] int32 (expert, first row, end row) of every row tile of block_m rows within one expert;
    n = cdiv(S, block_m) + E bounds the count without a host sync, the unused tiles are empty."""
    if block_m in routing.tile_tables:
        return routing.tile_tables[block_m]
    offsets = routing.offsets.long()
    experts, rows = offsets.numel() - 1, routing.perm.numel()
    counts = offsets[1:] - offsets[:-1]
    per = (counts + block_m - 1) // block_m
    ends = torch.cumsum(per, 0)
    pid = torch.arange(cdiv(rows, block_m) + experts, device=offsets.device)
    e = torch.searchsorted(ends, pid, right=True).clamp(max=experts - 1)
    first = offsets[e] + (pid - (ends[e] - per[e])) * block_m
    end = torch.minimum(first + block_m, offsets[e + 1])
    first = torch.where(pid < ends[-1], first, end)  # past the last tile: empty
    routing.tile_tables[block_m] = torch.stack([e, first, end]).to(torch.int32)
    return routing.tile_tables[block_m]


def _upcast(dtype: torch.dtype) -> bool:
    return interpreting() and dtype != torch.float32  # the interpreter's low-precision tl.dot is wrong


def _precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and (interpreting() or not torch.backends.cuda.matmul.allow_tf32):
        return "ieee"
    return "tf32"


@triton.jit
def _tile(TILES, n_tiles, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(expert, rows, row mask, columns, column-tile index) of this program; grouped order so GROUP_M
    row tiles share a weight tile while it is in L2."""
    pid = tl.program_id(0)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    group_m = min(n_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_m
    pid_n = (pid % width) // group_m
    e = tl.load(TILES + pid_m)
    first = tl.load(TILES + n_tiles + pid_m)
    end = tl.load(TILES + 2 * n_tiles + pid_m)
    rows = first + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return e, rows, rows < end, cols, pid_n, first < end


@triton.jit
def _dot_rows(acc, a_ptrs, a_mask, b_ptrs, n_mask, K, sb_k,
              BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc += A[rows, :K] @ B[:K, cols]; A has unit stride along K."""
    rk = tl.arange(0, BLOCK_K)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = rk < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=a_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * sb_k
    return acc


@fast_launch
@triton.jit
def _up_fwd(TILES, X, TOKEN, WG, WU, A1, H,
            n_tiles, N, K, sx, sg_e, sg_n, sg_k, su_e, su_n, su_k, sa1, sh,
            GATED: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    e, rows, row_mask, cols, pid_n, busy = _tile(TILES, n_tiles, N, BLOCK_M, BLOCK_N, GROUP_M)
    if busy:
        col_mask = cols < N
        token = tl.load(TOKEN + rows, mask=row_mask, other=0)
        rk = tl.arange(0, BLOCK_K)
        a_ptrs = X + token[:, None].to(tl.int64) * sx + rk[None, :]
        g_ptrs = WG + e.to(tl.int64) * sg_e + rk[:, None] * sg_k + cols[None, :] * sg_n
        u_ptrs = WU + e.to(tl.int64) * su_e + rk[:, None] * su_k + cols[None, :] * su_n
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            k_mask = rk < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                g = g.to(tl.float32)
            acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
            if GATED:
                u = tl.load(u_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
                if UPCAST:
                    u = u.to(tl.float32)
                acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K * sg_k
            u_ptrs += BLOCK_K * su_k
        mask = row_mask[:, None] & col_mask[None, :]
        act, dact = act_and_grad(acc_g, ACT)
        tl.store(A1 + rows[:, None].to(tl.int64) * sa1 + cols[None, :], acc_g.to(A1.dtype.element_ty), mask=mask)
        if GATED:
            tl.store(A1 + rows[:, None].to(tl.int64) * sa1 + N + cols[None, :], acc_u.to(A1.dtype.element_ty),
                     mask=mask)
            act = act * acc_u
        tl.store(H + rows[:, None].to(tl.int64) * sh + cols[None, :], act.to(H.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _down_fwd(TILES, H, WD, PERM, WEIGHT, SLOTS,
              n_tiles, N, K, sh, sd_e, sd_n, sd_k, ss,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
              UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    e, rows, row_mask, cols, pid_n, busy = _tile(TILES, n_tiles, N, BLOCK_M, BLOCK_N, GROUP_M)
    if busy:
        col_mask = cols < N
        rk = tl.arange(0, BLOCK_K)
        a_ptrs = H + rows[:, None].to(tl.int64) * sh + rk[None, :]
        b_ptrs = WD + e.to(tl.int64) * sd_e + rk[:, None] * sd_k + cols[None, :] * sd_n
        acc = _dot_rows(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), a_ptrs, row_mask, b_ptrs, col_mask, K, sd_k,
                        BLOCK_K, UPCAST, PRECISION)
        weight = tl.load(WEIGHT + rows, mask=row_mask, other=0.0)
        slot = tl.load(PERM + rows, mask=row_mask, other=0)
        tl.store(SLOTS + slot[:, None].to(tl.int64) * ss + cols[None, :], acc * weight[:, None],
                 mask=row_mask[:, None] & col_mask[None, :])


@fast_launch
@triton.jit
def _down_bwd(TILES, DOUT, TOKEN, WD, WEIGHT, A1, DA1, DWP,
              n_tiles, N, K, sdo, sd_e, sd_n, sd_k, sa1, sda1, n_col_tiles,
              GATED: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # here N = F (columns of h) and K = D; B[k, n] = w_down[e, k, n]
    e, rows, row_mask, cols, pid_n, busy = _tile(TILES, n_tiles, N, BLOCK_M, BLOCK_N, GROUP_M)
    if busy:
        col_mask = cols < N
        token = tl.load(TOKEN + rows, mask=row_mask, other=0)
        rk = tl.arange(0, BLOCK_K)
        a_ptrs = DOUT + token[:, None].to(tl.int64) * sdo + rk[None, :]
        b_ptrs = WD + e.to(tl.int64) * sd_e + rk[:, None] * sd_n + cols[None, :] * sd_k
        g = _dot_rows(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), a_ptrs, row_mask, b_ptrs, col_mask, K, sd_n,
                      BLOCK_K, UPCAST, PRECISION)
        mask = row_mask[:, None] & col_mask[None, :]
        a_in = A1 + rows[:, None].to(tl.int64) * sa1 + cols[None, :]
        pre = tl.load(a_in, mask=mask, other=0.0).to(tl.float32)
        act, dact = act_and_grad(pre, ACT)
        weight = tl.load(WEIGHT + rows, mask=row_mask, other=0.0)
        out = DA1 + rows[:, None].to(tl.int64) * sda1 + cols[None, :]
        if GATED:
            up = tl.load(a_in + N, mask=mask, other=0.0).to(tl.float32)
            h = act * up
            dh = g * weight[:, None]
            tl.store(out, (dh * up * dact).to(DA1.dtype.element_ty), mask=mask)
            tl.store(out + N, (dh * act).to(DA1.dtype.element_ty), mask=mask)
        else:
            h = act
            tl.store(out, (g * weight[:, None] * dact).to(DA1.dtype.element_ty), mask=mask)
        h = h.to(A1.dtype.element_ty).to(tl.float32)  # the h the forward stored and multiplied
        tl.store(DWP + rows.to(tl.int64) * n_col_tiles + pid_n, tl.sum(tl.where(mask, g * h, 0.0), 1), mask=row_mask)


@fast_launch
@triton.jit
def _up_bwd(TILES, DA1, WG, WU, PERM, SLOTS,
            n_tiles, N, K, sda1, sg_e, sg_n, sg_k, su_e, su_n, su_k, ss,
            GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            GROUP_M: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # here N = D and K = F; B[k, n] = w_gate[e, k, n]
    e, rows, row_mask, cols, pid_n, busy = _tile(TILES, n_tiles, N, BLOCK_M, BLOCK_N, GROUP_M)
    if busy:
        col_mask = cols < N
        rk = tl.arange(0, BLOCK_K)
        a_ptrs = DA1 + rows[:, None].to(tl.int64) * sda1 + rk[None, :]
        b_ptrs = WG + e.to(tl.int64) * sg_e + rk[:, None] * sg_n + cols[None, :] * sg_k
        acc = _dot_rows(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), a_ptrs, row_mask, b_ptrs, col_mask, K, sg_n,
                        BLOCK_K, UPCAST, PRECISION)
        if GATED:
            b_ptrs = WU + e.to(tl.int64) * su_e + rk[:, None] * su_n + cols[None, :] * su_k
            acc = _dot_rows(acc, a_ptrs + K, row_mask, b_ptrs, col_mask, K, su_n, BLOCK_K, UPCAST, PRECISION)
        slot = tl.load(PERM + rows, mask=row_mask, other=0)
        tl.store(SLOTS + slot[:, None].to(tl.int64) * ss + cols[None, :], acc,
                 mask=row_mask[:, None] & col_mask[None, :])


@fast_launch
@triton.jit
def _weight_grad(L, L_ROW, L_SCALE, R, R_ROW, OFFSETS, OUT,
                 P, Q, sl, sr, so_e, so_p, so_q,
                 L_GATHER: tl.constexpr, SCALE: tl.constexpr, R_GATHER: tl.constexpr,
                 BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """OUT[e] = sum over expert e's rows s of L[row_l(s), :P]^T R[row_r(s), :Q] (times L_SCALE[s])."""
    e = tl.program_id(1)
    grid_q = tl.cdiv(Q, BLOCK_Q)
    rp = (tl.program_id(0) // grid_q) * BLOCK_P + tl.arange(0, BLOCK_P)
    rq = (tl.program_id(0) % grid_q) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    p_mask, q_mask = rp < P, rq < Q
    first = tl.load(OFFSETS + e)
    end = tl.load(OFFSETS + e + 1)
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    for s0 in range(first, end, BLOCK_K):
        rs = s0 + tl.arange(0, BLOCK_K)
        s_mask = rs < end
        l_row = tl.load(L_ROW + rs, mask=s_mask, other=0) if L_GATHER else rs
        r_row = tl.load(R_ROW + rs, mask=s_mask, other=0) if R_GATHER else rs
        lt = tl.load(L + l_row[None, :].to(tl.int64) * sl + rp[:, None], mask=p_mask[:, None] & s_mask[None, :],
                     other=0.0)
        if SCALE:
            lt = (lt.to(tl.float32) * tl.load(L_SCALE + rs, mask=s_mask, other=0.0)[None, :]).to(L.dtype.element_ty)
        r = tl.load(R + r_row[:, None].to(tl.int64) * sr + rq[None, :], mask=s_mask[:, None] & q_mask[None, :],
                    other=0.0)
        if UPCAST:
            lt = lt.to(tl.float32)
            r = r.to(tl.float32)
        acc = tl.dot(lt, r, acc, input_precision=PRECISION)
    tl.store(OUT + e.to(tl.int64) * so_e + rp[:, None] * so_p + rq[None, :] * so_q, acc.to(OUT.dtype.element_ty),
             mask=p_mask[:, None] & q_mask[None, :])


# --- launchers -----------------------------------------------------------------------------------------
def _row_config(gated: bool) -> tuple:
    if interpreting():
        return INTERPRETER_ROW_CONFIG
    return GATED_CONFIG if gated else ROW_CONFIG


def _launch_rows(kernel, routing: Routing, n: int, gated: bool, args: tuple, dtype: torch.dtype, **flags):
    block_m, block_n, block_k, group_m, stages, warps = _row_config(gated)
    table = tiles(routing, block_m)
    n_tiles = table.shape[1]
    grid = (n_tiles * cdiv(n, block_n),)
    kernel[grid](table, *args, n_tiles, *flags.pop("sizes"),
                 BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
                 UPCAST=_upcast(dtype), PRECISION=_precision(dtype), num_stages=stages, num_warps=warps, **flags)
    return block_n


def forward(x, routing: Routing, w_gate, w_up, w_down, act: str, gated: bool):
    """(out [T, D], a1 [S, 2F or F] pre-activations, h [S, F]) for x [T, D]."""
    tokens, width = x.shape
    x = as_rows(x)  # the kernels gather whole unit-stride rows
    experts, ffn, _ = w_gate.shape
    rows = routing.perm.numel()
    a1 = alloc((rows, 2 * ffn if gated else ffn), x.dtype, x.device)
    h = alloc((rows, ffn), x.dtype, x.device)
    slots = torch.zeros((rows, width), dtype=torch.float32, device=x.device)
    if rows and ffn and width:
        wu = w_up if gated else w_gate
        _launch_rows(_up_fwd, routing, ffn, gated, (x, routing.token, w_gate, wu, a1, h), x.dtype,
                     sizes=(ffn, width, x.stride(0), *w_gate.stride(), *wu.stride(), a1.stride(0), h.stride(0)),
                     GATED=gated, ACT=ACTIVATIONS[act])
        _launch_rows(_down_fwd, routing, width, False, (h, w_down, routing.perm, routing.weight, slots), x.dtype,
                     sizes=(width, ffn, h.stride(0), *w_down.stride(), slots.stride(0)))
    out = slots.view(tokens, routing.top_k, width).sum(1).to(x.dtype)
    return out, a1, h


def backward(dout, x, routing: Routing, w_gate, w_up, w_down, a1, h, act: str, gated: bool,
             need_x: bool, need_weight: bool, dw_gate=None, dw_up=None, dw_down=None):
    """(dx or None, d routing weights [T, k] fp32 or None) of `forward`; the weight gradients are written
    into the views dw_gate / dw_up / dw_down (shaped like the weights) that are given."""
    tokens, width = x.shape
    x = as_rows(x)  # the kernels gather whole unit-stride rows
    experts, ffn, _ = w_gate.shape
    rows = routing.perm.numel()
    dout = dout.contiguous()
    wu = w_up if gated else w_gate
    da1 = alloc(a1.shape, x.dtype, x.device)
    block_n = _row_config(False)[1]
    dwp = torch.zeros((rows, cdiv(ffn, block_n)), dtype=torch.float32, device=x.device)
    empty = rows == 0 or ffn == 0 or width == 0
    if not empty:
        _launch_rows(_down_bwd, routing, ffn, False, (dout, routing.token, w_down, routing.weight, a1, da1, dwp),
                     x.dtype, sizes=(ffn, width, dout.stride(0), *w_down.stride(), a1.stride(0), da1.stride(0),
                                     dwp.shape[1]),
                     GATED=gated, ACT=ACTIVATIONS[act])
    dx = dweight = None
    if need_x:
        slots = torch.zeros((rows, width), dtype=torch.float32, device=x.device)
        if not empty:
            _launch_rows(_up_bwd, routing, width, False, (da1, w_gate, wu, routing.perm, slots), x.dtype,
                         sizes=(width, ffn, da1.stride(0), *w_gate.stride(), *wu.stride(), slots.stride(0)),
                         GATED=gated)
        dx = slots.view(tokens, routing.top_k, width).sum(1).to(x.dtype)
    if need_weight:
        flat = torch.zeros(rows, dtype=torch.float32, device=x.device)
        flat[routing.perm.long()] = dwp.sum(1)
        dweight = flat.view(tokens, routing.top_k)
    if dw_gate is not None:
        _weight_grad_into(dw_gate, routing, da1[:, :ffn], x, right_rows=routing.token)
    if dw_up is not None:
        _weight_grad_into(dw_up, routing, da1[:, ffn:], x, right_rows=routing.token)
    if dw_down is not None:
        _weight_grad_into(dw_down, routing, dout, h, left_rows=routing.token, scale=routing.weight)
    return dx, dweight


def _weight_grad_into(out: torch.Tensor, routing: Routing, left, right, left_rows=None, right_rows=None,
                      scale=None) -> None:
    """Writes into the weight-gradient view out [E, P, Q] (any strides), per expert, the sum over its
    sorted rows s of left[l(s), :P]^T right[r(s), :Q], where l / r gather through left_rows / right_rows
    when given (else the sorted row itself) and `scale` multiplies left's row s."""
    experts, p, q = out.shape
    if out.numel() == 0:
        return
    block_p, block_q, block_k, stages, warps = INTERPRETER_WEIGHT_CONFIG if interpreting() else WEIGHT_CONFIG
    unused = routing.token  # stands in for an index or scale pointer the kernel does not read
    grid = (cdiv(p, block_p) * cdiv(q, block_q), experts)
    _weight_grad[grid](
        left, unused if left_rows is None else left_rows, routing.weight if scale is None else scale,
        right, unused if right_rows is None else right_rows, routing.offsets, out,
        p, q, left.stride(0), right.stride(0), *out.stride(),
        L_GATHER=left_rows is not None, SCALE=scale is not None, R_GATHER=right_rows is not None,
        BLOCK_P=block_p, BLOCK_Q=block_q, BLOCK_K=block_k, UPCAST=_upcast(left.dtype),
        PRECISION=_precision(left.dtype), num_stages=stages, num_warps=warps,
    )
