"""The same experts computation as codegen/moe.py on `torch._grouped_mm` (CUTLASS on Hopper), the other
side of the shape-dependent choice: the permuted copies are made with gathers, the activation runs in
codegen/glu.py, and the routing weight multiplies the rows before an fp32 slot sum.

Forward:  xs = x[token]; a1 = gmm(xs, w_gate_up); h = act(gate) * up; y = gmm(h, w_down);
          out = sum over slots of weight * y
Backward: g = gmm(dout[token], w_down^T); d weight = <g, h>; dh = weight * g; d a1 from the activation;
          dx = slot sum of gmm(d a1, w_gate_up^T); dW = gmm(d a1^T, xs), gmm((weight * dout[token])^T, h)
`gmm` is grouped over the experts' row ranges (`Routing.offsets`); weight gradients group over K.
Needs unit-stride, 16-byte aligned rows and weights whose gate and up halves are one [E, 2F, D]
tensor (or no gate): `supports` says why not otherwise.
"""
import torch

from fusion_compiler._compat import FakeTensor, grouped_mm

from .glu import glu_bwd, glu_fwd
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
    for t in (x, w_gate_up, w_down):  # (a compile-time check sees fake tensors: sizes only)
        if (t.shape[-1] * t.element_size()) % 16 or (not isinstance(t, FakeTensor) and t.data_ptr() % 16):
            return "rows are not 16-byte aligned"
    return None


def _valid(routing: Routing) -> torch.Tensor:
    rows = routing.perm.numel()
    return (torch.arange(rows, device=routing.perm.device) < routing.offsets[-1])[:, None]


def _slot_sum(rows_out: torch.Tensor, routing: Routing, tokens: int, scale: torch.Tensor | None):
    """sum over each token's k slots of (scale *) rows_out, in fp32; rows past the last expert are 0."""
    vals = rows_out.float() * scale[:, None] if scale is not None else rows_out.float()
    slots = torch.empty_like(vals)
    slots[routing.perm.long()] = torch.where(_valid(routing), vals, 0.0)
    return slots.view(tokens, routing.top_k, -1).sum(1)


def forward(x, routing: Routing, w_gate_up, w_down, act: str, gated: bool):
    """(out, a1, h) as codegen.moe.forward; w_gate_up is [E, 2F, D] ([gate; up]) or [E, F, D] ungated."""
    ends = routing.offsets[1:]
    a1 = grouped_mm(x[routing.token.long()], w_gate_up.transpose(1, 2), offs=ends)
    ffn = w_down.shape[-1]
    h = glu_fwd(a1[:, :ffn], a1[:, ffn:], act) if gated else _ACT[act](a1)
    y = grouped_mm(h, w_down.transpose(1, 2), offs=ends)
    return _slot_sum(y, routing, x.shape[0], routing.weight).to(x.dtype), a1, h


def backward(dout, x, routing: Routing, w_gate_up, w_down, a1, h, act: str, gated: bool, needs: tuple):
    """(dx, d routing weights [T, k] fp32, dw_gate_up, dw_down), None where `needs` (x, weights,
    w_gate_up, w_down) says no."""
    ends, tokens, ffn = routing.offsets[1:], x.shape[0], w_down.shape[-1]
    token = routing.token.long()
    dout_rows = dout.contiguous()[token]
    g = grouped_mm(dout_rows, w_down, offs=ends)
    valid = _valid(routing)
    dh = torch.where(valid, g.float() * routing.weight[:, None], 0.0).to(x.dtype)
    if gated:
        da1 = torch.empty_like(a1)
        glu_bwd(dh, a1[:, :ffn], a1[:, ffn:], act, da1[:, :ffn], da1[:, ffn:])
    else:
        da1 = (dh.float() * _act_grad(act, a1)).to(x.dtype)
    dx = dweight = dw_gate_up = dw_down = None
    if needs[0]:
        dx = _slot_sum(grouped_mm(da1, w_gate_up, offs=ends), routing, tokens, None).to(x.dtype)
    if needs[1]:
        flat = torch.zeros(routing.perm.numel(), dtype=torch.float32, device=x.device)
        flat[routing.perm.long()] = torch.where(valid, g.float() * h.float(), 0.0).sum(1)
        dweight = flat.view(tokens, routing.top_k)
    if needs[2]:
        dw_gate_up = grouped_mm(da1.t(), x[token], offs=ends)  # rows past the groups are not read
    if needs[3]:
        scaled = (dout_rows.float() * routing.weight[:, None]).to(x.dtype)
        dw_down = grouped_mm(scaled.t(), h, offs=ends)
    return dx, dweight, dw_gate_up, dw_down
