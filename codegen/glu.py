"""Gated linear units: y = act(gate) * up, act in {silu, gelu (erf), gelu (tanh)}, forward and backward.

    silu(g)      = g * s,                       s = sigmoid(g)
    silu'(g)     = s * (1 + g * (1 - s))
    gelu(g)      = g * Phi(g),                  Phi(g) = (1 + erf(g / sqrt 2)) / 2
    gelu'(g)     = Phi(g) + g * exp(-g^2 / 2) / sqrt(2 pi)
    gelu_tanh(g) = g * (1 + t) / 2,             t = tanh(sqrt(2/pi) * (g + 0.044715 g^3))
    gelu_tanh'   = (1 + t) / 2 + g * (1 - t^2) * sqrt(2/pi) * (1 + 3 * 0.044715 g^2) / 2
Backward: d_gate = dy * up * act'(gate), d_up = dy * act(gate). The forward may scale each row (`row_scale`).
gate, up and their gradients are [rows, N] views with their own row strides, so the halves of a fused
gate/up projection are read (and their gradients written) in place, with no copy or concatenation.
With an FP8 dtype the forward keeps whole rows (N <= fp8.ROW_MAX) and also writes y's FP8 copy with a
scale per row (codegen/fp8.py; y as stored, rounded to its dtype, is what is cast): the input of the
FP8 linear that reads y (patterns/fp8.py), which then skips its own cast.
"""
import torch
import triton
import triton.language as tl

from . import fp8
from .launch import alloc, as_rows, cdiv, fast_launch, interpreting, next_pow2, row_tile

ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


@triton.jit
def act_and_grad(g, ACT: tl.constexpr):
    if ACT == 0:
        s = tl.sigmoid(g)
        a = g * s
        da = s * (1.0 + g * (1.0 - s))
    elif ACT == 1:
        phi = 0.5 * (1.0 + tl.erf(g * 0.7071067811865476))
        a = g * phi
        da = phi + g * tl.exp(-0.5 * g * g) * 0.3989422804014327
    else:
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = 2.0 * tl.sigmoid(2.0 * u) - 1.0
        a = 0.5 * g * (1.0 + t)
        da = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * g * g)
    return a, da


@fast_launch
@triton.jit
def _glu_fwd_kernel(
    # pointers
    GATE, UP, SCALE, Y, Q, INV,
    # sizes
    M, N,
    # row strides
    stride_g, stride_u, stride_y,
    # meta-parameters
    ACT: tl.constexpr, SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    # the FP8 copy of y (QUANT: BLOCK_N covers the row), codegen/fp8.cast_args
    QUANT: tl.constexpr, FP8_TYPE: tl.constexpr, FP8_MAX: tl.constexpr, ROUND: tl.constexpr, MANT: tl.constexpr,
    MIN_NORMAL: tl.constexpr, SUB_STEP: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    g = tl.load(GATE + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a, _ = act_and_grad(g, ACT)
    y = a * u
    if SCALED:
        y = y * tl.load(SCALE + rows, mask=rows < M, other=0.0)[:, None]
    y = y.to(Y.dtype.element_ty)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y, mask=mask)
    if QUANT:
        q, inv = fp8.quantize_rows_tile(y.to(tl.float32), FP8_TYPE, FP8_MAX, ROUND, MANT, MIN_NORMAL, SUB_STEP)
        tl.store(Q + rows[:, None].to(tl.int64) * N + cols[None, :], q, mask=mask)
        tl.store(INV + rows, inv, mask=rows < M)


@fast_launch
@triton.jit
def _glu_bwd_kernel(
    # pointers
    DY, GATE, UP, DGATE, DUP,
    # sizes
    M, N,
    # row strides
    stride_dy, stride_g, stride_u, stride_dg, stride_du,
    # meta-parameters
    ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(GATE + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a, da = act_and_grad(g, ACT)
    tl.store(DGATE + rows[:, None] * stride_dg + cols[None, :], (dy * u * da).to(DGATE.dtype.element_ty), mask=mask)
    tl.store(DUP + rows[:, None] * stride_du + cols[None, :], (dy * a).to(DUP.dtype.element_ty), mask=mask)


def _tile(n: int) -> tuple[int, int]:
    block_n = min(next_pow2(max(n, 1)), 1024)
    block_m = max(1, (16384 if interpreting() else 2048) // block_n)
    return block_m, block_n


def glu_fwd(gate, up, act: str, fp8_dtype=None, row_scale=None):
    """act(gate) * up for gate and up of one shape: a contiguous tensor of that shape; with an fp8_dtype
    (rows of at most fp8.ROW_MAX), (y, q [rows, N] row-major, its dequantization scale [rows, 1] fp32).
    row_scale: fp32 [rows], each row's product times it before rounding (the MoE's routing weights)."""
    n = gate.shape[-1]
    g2, u2 = as_rows(gate), as_rows(up)
    m = g2.shape[0]
    y = alloc((m, n), torch.promote_types(gate.dtype, up.dtype), gate.device)
    q = inv = None
    if fp8_dtype is None:
        (block_m, block_n), warps = _tile(n), 4
    else:
        if n > fp8.ROW_MAX:
            raise ValueError(f"glu_fwd: the FP8 copy keeps whole rows, at most {fp8.ROW_MAX} wide, not {n}")
        block_m, block_n, warps = row_tile(n)
        q, inv = alloc((m, n), fp8_dtype, gate.device), alloc((m, 1), torch.float32, gate.device)
    if m * n > 0:
        _glu_fwd_kernel[(cdiv(m, block_m), cdiv(n, block_n))](
            g2, u2, y if row_scale is None else row_scale, y, y if q is None else q, y if inv is None else inv, m, n,
            g2.stride(0), u2.stride(0), y.stride(0), ACT=ACTIVATIONS[act], SCALED=row_scale is not None,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
            QUANT=q is not None, **fp8.cast_args(fp8_dtype or torch.float8_e4m3fn),
        )
    y = y.view(gate.shape)
    return y if q is None else (y, q, inv)


def glu_bwd(dy, gate, up, act: str, dgate=None, dup=None):
    """Gradients of act(gate) * up; writes into dgate/dup (views, e.g. halves of one buffer) if given."""
    n = gate.shape[-1]
    dy2, g2, u2 = as_rows(dy), as_rows(gate), as_rows(up)
    m = g2.shape[0]
    dgate = alloc((m, n), gate.dtype, gate.device) if dgate is None else dgate
    dup = alloc((m, n), up.dtype, up.device) if dup is None else dup
    block_m, block_n = _tile(n)
    if m * n > 0:
        _glu_bwd_kernel[(cdiv(m, block_m), cdiv(n, block_n))](
            dy2, g2, u2, dgate, dup, m, n,
            dy2.stride(0), g2.stride(0), u2.stride(0), dgate.stride(0), dup.stride(0),
            ACT=ACTIVATIONS[act], BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4,
        )
    return dgate, dup
