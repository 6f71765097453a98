"""The same experts computation as codegen/moe.py on `torch._grouped_mm` (CUTLASS on Hopper), the other
side of the shape-dependent choice: CUTLASS runs the GEMMs, the glue around them is one pass each,
token-major: a program takes a block of tokens, reads each token's row once and visits its k sorted
rows through the inverse permutation (`row(t, j)`), which a gather through `token` would read k times.

Forward:  xs[row(t, j)] = x[t] (`_spread_kernel`); a1 = gmm(xs, w_gate_up) (gate and up apart: two
          products, kept apart); h = w * act(gate) * up, w the row's routing weight (codegen/glu.py);
          y = gmm(h, w_down); out[t] = sum_j y[row(t, j)] in fp32 (`combine`). The weight rides on h
          (F wide) rather than on y (D wide): y is not saved.
Backward: dy[row(t, j)] = dout[t] (`_spread_kernel`); dh = gmm(dy, w_down^T); d a1 and
          d weight = <dh, act(gate) * up> (in slot order) in one pass (`_glu_grad_kernel`);
          dx = `combine` of gmm(d a1, w_gate_up^T) (gate and up apart: both products' rows summed in
          the combine); dW_gate_up = gmm(d a1^T, xs) (xs saved by the forward), dW_down = gmm(dy^T, h).
With torchtitan's score-before-experts the weight scales the token rows in xs instead.
`gmm` is grouped over the experts' row ranges (`Routing.offsets`); weight gradients group over K.
Needs unit-stride, 16-byte aligned rows and weights (gate and up as one [E, 2F, D] tensor or apart,
not interleaved): `supports` says why not otherwise.
"""
import torch
import triton
import triton.language as tl

from fusion_compiler._compat import grouped_mm

from .glu import ACTIVATIONS, act_and_grad, glu_bwd, glu_fwd
from .launch import alloc, cdiv, fast_launch, interpreting, next_pow2
from .moe import Routing

_ACT = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu,
        "gelu_tanh": lambda v: torch.nn.functional.gelu(v, approximate="tanh")}


def _act_grad(act: str, g: torch.Tensor) -> torch.Tensor:
    """act'(g) in fp32 (the formulas of codegen/glu.py)."""
    g = g.float()
    if act == "silu":
        s = torch.sigmoid(g)
        return s * (1 + g * (1 - s))
    if act == "gelu":
        return 0.5 * (1 + torch.erf(g * 0.7071067811865476)) + g * torch.exp(-0.5 * g * g) * 0.3989422804014327
    t = torch.tanh(0.7978845608028654 * (g + 0.044715 * g ** 3))
    return 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * 0.7978845608028654 * (1 + 0.134145 * g * g)


def supports(x: torch.Tensor, w_gate_up: torch.Tensor | None, w_down: torch.Tensor) -> str | None:
    """None when the grouped_mm path can run these operands, else why not."""
    if grouped_mm is None:
        return "this torch has no grouped_mm"
    if x.device.type == "cuda" and x.dtype != torch.bfloat16:
        return f"grouped_mm on CUDA takes bfloat16, not {x.dtype}"
    if w_gate_up is None:
        return "gate and up weights are not one [E, 2F, D] tensor"
    for t in (x, w_gate_up, w_down):  # one of the last two dims unit-stride, the other strides 16-byte
        unit = [d for d in (-1, -2) if t.stride(d) == 1]
        if not unit or any((stride * t.element_size()) % 16 for d, stride in enumerate(t.stride())
                           if d - t.dim() != unit[0]):
            return "operands are not unit-stride along one of their last two dims with 16-byte aligned strides"
    return None


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it when its storage does not start 16-byte aligned (grouped_mm needs it; the
    choice of path is made on shapes alone, so a view's offset is fixed here)."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


@fast_launch
@triton.jit
def _combine_kernel(Y, Y2, ROW, W, END, OUT, X, DOT, n_tokens, D, sy, sy2, so, sx, TOP_K: tl.constexpr,
                    WEIGHTED: tl.constexpr, TWO: tl.constexpr, DOTS: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """OUT[t] = sum_j (W[t, j] *) y_j, y_j = Y[ROW[t * k + j]] (+ Y2[ROW[t * k + j]] when TWO), in fp32;
    rows at or past END (no expert's) add 0. DOTS: also DOT[b, t * k + j] = <y_j, X[t]> over this
    program's column block b, in fp32 (the caller sums the blocks: no atomics, the same sum each run)."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_mask, d_mask = tokens < n_tokens, cols < D
    end = tl.load(END)
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    if DOTS:
        x = tl.load(X + tokens[:, None].to(tl.int64) * sx + cols[None, :], mask=t_mask[:, None] & d_mask[None, :],
                    other=0.0).to(tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(ROW + tokens * TOP_K + j, mask=t_mask, other=0)
        ok = t_mask & (row < end)
        mask = ok[:, None] & d_mask[None, :]
        y = tl.load(Y + row[:, None].to(tl.int64) * sy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if TWO:
            y += tl.load(Y2 + row[:, None].to(tl.int64) * sy2 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if DOTS:
            tl.store(DOT + tl.program_id(1) * n_tokens * TOP_K + tokens * TOP_K + j, tl.sum(y * x, 1), mask=t_mask)
        if WEIGHTED:
            y = y * tl.load(W + tokens * TOP_K + j, mask=t_mask, other=0.0)[:, None]
        acc += y
    tl.store(OUT + tokens[:, None].to(tl.int64) * so + cols[None, :], acc.to(OUT.dtype.element_ty),
             mask=t_mask[:, None] & d_mask[None, :])


@fast_launch
@triton.jit
def _spread_kernel(X, ROW, W, OUT, n_tokens, D, sx, sx_d, so,
                   TOP_K: tl.constexpr, SCALED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """OUT[ROW[t * k + j]] = X[t] (times W[t * k + j], rounded from fp32, when SCALED) for every slot j."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_mask = tokens < n_tokens
    mask = t_mask[:, None] & (cols < D)[None, :]
    x = tl.load(X + tokens[:, None].to(tl.int64) * sx + cols[None, :] * sx_d, mask=mask, other=0.0)
    for j in tl.static_range(TOP_K):
        row = tl.load(ROW + tokens * TOP_K + j, mask=t_mask, other=0)
        if SCALED:
            scale = tl.load(W + tokens * TOP_K + j, mask=t_mask, other=0.0)
            value = (x.to(tl.float32) * scale[:, None]).to(OUT.dtype.element_ty)
        else:
            value = x
        tl.store(OUT + row[:, None].to(tl.int64) * so + cols[None, :], value, mask=mask)


@fast_launch
@triton.jit
def _glu_grad_kernel(DH, GATE, UP, PERM, W, END, DGATE, DUP, DW, M, N, s_dh, s_g, s_u, s_dg, s_du,
                     ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The backward of h = W[r] * act(GATE) * UP for sorted rows r (W[r] the row's routing weight, read at
    its slot PERM[r]): DGATE, DUP from DH = d h, and DW[PERM[r]] = <DH[r], act(GATE[r]) * UP[r]> in
    fp32, the routing weight's gradient in slot order; rows at or past END (no expert's) get zeros."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    r_mask = rows < M
    ok = r_mask & (rows < tl.load(END))
    slot = tl.load(PERM + rows, mask=r_mask, other=0)
    weight = tl.load(W + slot, mask=ok, other=0.0)
    rows64 = rows[:, None].to(tl.int64)
    dot = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        load = ok[:, None] & (cols < N)[None, :]
        dh = tl.load(DH + rows64 * s_dh + cols[None, :], mask=load, other=0.0).to(tl.float32)
        g = tl.load(GATE + rows64 * s_g + cols[None, :], mask=load, other=0.0).to(tl.float32)
        u = tl.load(UP + rows64 * s_u + cols[None, :], mask=load, other=0.0).to(tl.float32)
        a, da = act_and_grad(g, ACT)
        dot += tl.sum(dh * a * u, 1)
        dh = dh * weight[:, None]
        store = r_mask[:, None] & (cols < N)[None, :]
        tl.store(DGATE + rows64 * s_dg + cols[None, :], (dh * u * da).to(DGATE.dtype.element_ty), mask=store)
        tl.store(DUP + rows64 * s_du + cols[None, :], (dh * a).to(DUP.dtype.element_ty), mask=store)
    tl.store(DW + slot, dot, mask=r_mask)


def _glu_tile(n: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of `_glu_grad_kernel`: one row a program in blocks of up to 1024 columns (on the
    H100 the best of 1-16 rows x 128-1024 columns x 4-8 warps at F = 4096 and 768, within 1.5%;
    benchmarks/runs/2026-12-06-h100-tune-moe-glue.json; the interpreter's tiles are its own)."""
    if interpreting():
        return 16, min(next_pow2(max(n, 1)), 256)
    return 1, min(next_pow2(max(n, 1)), 1024)


def _tile(n: int, tokens: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_D): `tokens` per program and rows of up to 2048 in one tile (on the H100 the
    best of 1-8 tokens x 512-2048 columns x 4-8 warps for each kernel at bench_moe.py's two shapes,
    benchmarks/runs/2026-12-05-h100-tune-moe-glue.json; the interpreter's tiles are its own)."""
    if interpreting():
        return 16, min(next_pow2(max(n, 1)), 256)
    return tokens, min(next_pow2(max(n, 1)), 2048)


def combine(rows_out: torch.Tensor, routing: Routing, tokens: int, weighted: bool,
            dtype: torch.dtype, plus: torch.Tensor | None = None, dot_with: torch.Tensor | None = None):
    """[T, D] in dtype: each token's k slot rows of rows_out (sorted order), plus those of `plus` when
    given, summed in fp32, times the routing weight when `weighted`; and with `dot_with` (x [T, D]),
    [T * k] fp32: each slot's row (before the weight) dotted with its token's row of x (else None)."""
    width = rows_out.shape[1]
    out = alloc((tokens, width), dtype, rows_out.device)
    block_t, block_d = _tile(width, 1)
    dots = None
    if dot_with is not None:  # a row of partial dots per column block
        dots = alloc((cdiv(width, block_d), tokens * routing.top_k), torch.float32, rows_out.device)
    if tokens and width:
        flat_weight = routing.slot_weight if weighted else routing.inverse  # (unread when not weighted)
        second = rows_out if plus is None else plus  # (unread without `plus`)
        x = out if dot_with is None else dot_with.contiguous()  # (unread without `dot_with`)
        _combine_kernel[(cdiv(tokens, block_t), cdiv(width, block_d))](
            rows_out, second, routing.inverse, flat_weight, routing.offsets[-1:], out, x, out if dots is None else dots,
            tokens, width, rows_out.stride(0), second.stride(0), out.stride(0), x.stride(0), TOP_K=routing.top_k,
            WEIGHTED=weighted, TWO=plus is not None, DOTS=dots is not None, BLOCK_T=block_t, BLOCK_D=block_d,
            num_warps=4)
    if dots is not None:
        dots = dots[0] if dots.shape[0] == 1 else dots.sum(0)
    return out, dots


def _rows(x, routing: Routing, scale_input: bool) -> torch.Tensor:
    """The token rows in expert order (a copy), times the routing weight when the weight scales the
    experts' input (torchtitan's score-before-experts)."""
    tokens, width = x.shape
    rows = alloc((routing.perm.numel(), width), x.dtype, x.device)
    block_t, block_d = _tile(width, 4)
    if tokens and width:
        _spread_kernel[(cdiv(tokens, block_t), cdiv(width, block_d))](
            x, routing.inverse, routing.slot_weight, rows, tokens, width, x.stride(0), x.stride(1), rows.stride(0),
            TOP_K=routing.top_k, SCALED=scale_input, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4)
    return rows


def _in_slot_order(routing: Routing, per_row: torch.Tensor) -> torch.Tensor:
    """A value per sorted row (fp32) moved to slot order (t * k + j); 0 for rows no expert's."""
    valid = torch.arange(per_row.numel(), device=per_row.device) < routing.offsets[-1]
    out = torch.empty_like(per_row)
    out[routing.perm.long()] = torch.where(valid, per_row, 0.0)
    return out


def _halves(a1: torch.Tensor, a1_up: torch.Tensor | None, ffn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) pre-activations: a1's two halves, or a1 and a1_up (gate and up weights apart)."""
    return (a1[:, :ffn], a1[:, ffn:]) if a1_up is None else (a1, a1_up)


def forward(x, routing: Routing, ups: list, w_down, act: str, gated: bool, scale_input: bool = False):
    """(out, a1, a1_up, h, rows) as codegen.moe.forward, but h is times each row's routing weight (unless
    the weight scales the input), so the combine is a plain sum; rows = the gathered token rows (the
    up weights' gradient reads them: saved rather than gathered again). `ups`: the first projection's
    weights [E, N, D]: [gate; up] in one tensor (a1 = both products, a1_up None), gate and up apart
    (a1 = the gate's product, a1_up the up's: not concatenated), or up alone."""
    ends, ups, w_down = routing.offsets[1:], [_aligned(u) for u in ups], _aligned(w_down)
    rows = _rows(x, routing, scale_input)
    a1, *a1_up = [grouped_mm(rows, u.transpose(1, 2), offs=ends) for u in ups]
    a1_up = a1_up[0] if a1_up else None
    ffn, scale = w_down.shape[-1], None if scale_input else routing.weight
    if gated:
        h = glu_fwd(*_halves(a1, a1_up, ffn), act, row_scale=scale)
    else:
        h = _ACT[act](a1.float())
        h = (h if scale is None else h * scale[:, None]).to(a1.dtype)
    y = grouped_mm(h, w_down.transpose(1, 2), offs=ends)
    out, _ = combine(y, routing, x.shape[0], False, x.dtype)
    return out, a1, a1_up, h, rows


def backward(dout, x, routing: Routing, ups: list, w_down, a1, a1_up, h, act: str, gated: bool, scale_input: bool,
             needs: tuple, rows_in=None):
    """(dx, d routing weights [T, k] fp32, [d up weights], d w_down), None where `needs` (x, weights,
    each of ups, w_down) says no. a1, a1_up, h: the forward's (h times the routing weights unless they
    scale the input); rows_in: the forward's gathered rows (gathered again when absent)."""
    ends, tokens, ffn = routing.offsets[1:], x.shape[0], w_down.shape[-1]
    ups, w_down = [_aligned(u) for u in ups], _aligned(w_down)
    rows, width = routing.perm.numel(), x.shape[1]
    dout = dout.contiguous()
    dy = _rows(dout, routing, False)
    dh = grouped_mm(dy, w_down, offs=ends)  # d h
    dw_slots = None
    if gated:
        gate, up = _halves(a1, a1_up, ffn)
        da1 = alloc((rows, 2 * ffn), a1.dtype, a1.device)
    if gated and not scale_input:  # d weight = <d h, act(gate) * up>, in slot order (t * k + j)
        dw_slots = alloc((rows,), torch.float32, x.device)
        block_m, block_n = _glu_tile(ffn)
        if rows and ffn:
            _glu_grad_kernel[(cdiv(rows, block_m),)](
                dh, gate, up, routing.perm, routing.slot_weight, routing.offsets[-1:], da1, da1[:, ffn:],
                dw_slots, rows, ffn, dh.stride(0), gate.stride(0), up.stride(0), da1.stride(0), da1.stride(0),
                ACT=ACTIVATIONS[act], BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4)
    elif gated:
        glu_bwd(dh, gate, up, act, da1[:, :ffn], da1[:, ffn:])
    else:
        dh = dh.float()
        if not scale_input:
            dw_slots = _in_slot_order(routing, (dh * _ACT[act](a1.float())).sum(1))
            dh = dh * routing.weight[:, None]
        da1 = (dh * _act_grad(act, a1)).to(x.dtype)
    slices = [da1] if len(ups) == 1 else [da1[:, :ffn], da1[:, ffn:]]
    dx = dweight = None
    if needs[0] or (scale_input and needs[1]):
        # d rows: one product a weight of the first projection (two with gate and up apart)
        d_rows = [grouped_mm(part, u, offs=ends) for part, u in zip(slices, ups)]
        # dx: the two products' rows summed in the combine (no pass adding them first); with the weight on
        # the input, d weight = <d rows, x[token]> in the same pass, in slot order
        dx, dots = combine(d_rows[0], routing, tokens, scale_input, x.dtype, *d_rows[1:],
                           dot_with=x if scale_input and needs[1] else None)
        if dots is not None:
            dw_slots = dots
        dx = dx if needs[0] else None
        del d_rows  # freed before the weight gradients are allocated
    if needs[1]:
        dweight = dw_slots.view(tokens, routing.top_k)
    d_ups = [None] * len(ups)
    if any(needs[2:2 + len(ups)]):
        inputs = rows_in if rows_in is not None and rows_in.numel() else _rows(x, routing, scale_input)
        d_ups = [grouped_mm(part.t(), inputs, offs=ends) if need else None
                 for part, need in zip(slices, needs[2:2 + len(ups)])]
    dw_down = grouped_mm(dy.t(), h, offs=ends) if needs[-1] else None
    return dx, dweight, d_ups, dw_down
