"""Attention family, on SDPA calls already in the graph: a causal mask known at compile time becomes
SDPA's is_causal, and keys/values repeated to every query head (repeat_kv) go in unrepeated
(enable_gqa).

HF transformers 5.x under torch.compile on torch < 2.14 builds the causal mask as a tensor (its is_causal
shortcut is skipped while compiling), and with a mask it repeats k and v per query head. SDPA then reads
a B x Lq x Lk mask and computes every score tile: in the reference Llama step on the H100 (stop 37)
cuDNN's kernels took 0.94 ms a layer forward and backward there, against 0.43 ms with is_causal on the
same inputs (benchmarks/bench_sdpa_backends.py), plus the mask and the copies of k and v.

    before: sdpa(q, repeat_kv(k), repeat_kv(v), attn_mask=causal)  (a fused SDPA op of the device)
    after:  sdpa(q, k, v, is_causal=True, enable_gqa=True)
The mask must depend on no graph input (its value is computed at compile time) and keep exactly j <= i
of square score matrices (bool, or additive: 0 kept, <= DROPPED dropped); only the op's output may be
used (not its logsumexp). Where the mask stays, k and v stay repeated (a masked GQA call has no fused
kernel on CUDA). On CUDA devices of compute capability >= 9.0 the call prefers cuDNN's kernels
(measured faster than flash at head dims 64 and 128, stop 37), with flash, memory-efficient and math
after them. A pass of its own: SDPA's aten op
differs by device (flash_for_cpu, efficient, cudnn), which a traced search function cannot span.
"""
import contextlib
import operator
import types

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.operator_schemas import normalize_function
from torch.nn.attention import SDPBackend, sdpa_kernel

from fusion_compiler import _compat, cost
from fusion_compiler.canonical import trace_function, val
from fusion_compiler.constants import constant_value, is_causal_mask
from fusion_compiler.decisions import Decision, describe, location
from fusion_compiler import engine
from fusion_compiler.engine import random_like
from fusion_compiler.matcher import Match

DESCRIPTOR = types.SimpleNamespace(name="sdpa_causal_mask", family="attention")
aten = torch.ops.aten
# the fused SDPA ops and the name of their mask argument
MASK_ARG = {aten._scaled_dot_product_flash_attention_for_cpu.default: "attn_mask",
            aten._scaled_dot_product_efficient_attention.default: "attn_bias",
            aten._scaled_dot_product_cudnn_attention.default: "attn_bias"}
CUDNN_FIRST = (9, 0)  # compute capability from which cuDNN's attention goes first
# an additive mask entry at most this drops its score: torch converts a bool mask to -65504 instead of -inf
# for cuDNN's kernels (torch 2.11, seen on the H100 at stop 37); exp(s - 65504 - max) is 0 in fp32 unless
# a masked score exceeds the row's largest kept one by more than ~65400
DROPPED = -65504.0
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
# the fused ops told by an argument whether to compute the logsumexp their backward reads
LSE_FLAG = (aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_cudnn_attention.default)


def _arguments(node: fx.Node) -> dict:
    return normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs


def unrepeated(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(x, n) when node is repeat_kv(x, n): view(clone?(expand(unsqueeze(x, 2)))) with only the new
    dim expanded, from x (B, KV, L, D) to (B, KV * n, L, D); else None."""
    if node.op != "call_function" or node.target not in _VIEWS:
        return None
    src = node.args[0]
    if src.op == "call_function" and src.target is aten.clone.default:
        src = src.args[0]
    if src.op != "call_function" or src.target is not aten.expand.default:
        return None
    unsq = src.args[0]
    if unsq.op != "call_function" or unsq.target is not aten.unsqueeze.default:
        return None
    x, dim = unsq.args
    xv, ev, out = val(x), val(src), val(node)
    if xv is None or ev is None or out is None or xv.dim() != 4 or dim not in (2, -3):
        return None
    b, kv, length, d = xv.shape
    if tuple(ev.shape) != (b, kv, ev.shape[2], length, d) or tuple(out.shape) != (b, kv * ev.shape[2], length, d):
        return None
    return x, ev.shape[2]


def _keeps_causal(mask: torch.Tensor) -> bool:
    """SDPA's mask semantics: bool True keeps; float is added to the scores, 0 on and below the diagonal
    and at most DROPPED above it."""
    if mask.dtype == torch.bool:
        return is_causal_mask(~mask, additive=False)
    return is_causal_mask(mask, additive=True, dropped=DROPPED)


def _mask_rule(node: fx.Node, args: dict) -> str | None:
    """None when the node's mask can become is_causal, else why not."""
    mask = args.get(MASK_ARG[node.target])
    q, k = val(args["query"]), val(args["key"])
    if args.get("is_causal"):
        return "is_causal already set, and a mask besides"
    if q.shape[-2] != k.shape[-2]:
        return f"query length {q.shape[-2]} != key length {k.shape[-2]}: is_causal aligns the diagonal at the top left"
    value = constant_value(mask)
    if value is None:
        return "mask computed from graph inputs (padding, a buffer): not known at compile time"
    if not _keeps_causal(value):
        return f"constant mask {list(value.shape)} is not causal ({_describe_mask(value)})"
    return None


def _describe_mask(value: torch.Tensor) -> str:
    """What a constant mask holds: its dtype, a few of its values, and how much of each triangle it keeps."""
    keeps = value if value.dtype == torch.bool else value == 0
    below = torch.ones(value.shape[-2:], dtype=torch.bool, device=value.device).tril().expand_as(value)
    shown = ", ".join(f"{v:g}" for v in value.unique()[:4].float().tolist())
    return (f"{str(value.dtype).replace('torch.', '')}, values {shown}; keeps "
            f"{keeps[below].float().mean().item():.1%} of j <= i and "
            f"{keeps[~below].float().mean().item():.1%} of j > i")


def _uses_output_only(node: fx.Node) -> bool:
    return all(u.op == "call_function" and u.target is operator.getitem and u.args[1] == 0 for u in node.users)


CUDNN_ORDER = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
               SDPBackend.MATH]


def _orders(device: torch.device) -> list:
    """The backend orders to try, best first: cuDNN's attention first where it was measured faster
    (Hopper), then torch's own order (None)."""
    if device.type == "cuda" and torch.cuda.is_available() and \
            torch.cuda.get_device_capability(device) >= CUDNN_FIRST:
        return [CUDNN_ORDER, None]
    return [None]


def _causal_sdpa(dropout_p: float, scale, gqa: bool, order):
    def attend(q, k, v):
        with sdpa_kernel(order, set_priority=True) if order else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale,
                                                  enable_gqa=gqa)
    return attend


def keep_logsumexp(replacement: fx.GraphModule) -> None:
    """make_fx traces the new call on inputs that need no grad, so a fused op that computes its
    logsumexp only when asked is told not to. In training its backward reads it: cuDNN's op then
    returns none, which Inductor's output checks reject (the H100, stop 38). In inference too, the
    op's meta function always promises one; it costs B x H x L floats."""
    for n in replacement.graph.nodes:
        if n.op == "call_function" and n.target in LSE_FLAG:
            n.args = (*n.args[:4], True, *n.args[5:])  # compute_log_sumexp, positional
    replacement.recompile()


_CHECKED: dict = {}  # (traced call, signature) -> None or why the new call failed its check
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}  # two fused kernels' roundings


def _checked(attend: fx.GraphModule, q, k, v, mask, n_rep: int, scale, dropout_p: float,
             training: bool) -> str | None:
    """Run the new call (attend: the traced graph that goes in) once on random data of this signature
    (its backward too when training) and, without dropout, compare its output with the call it replaces
    (the mask read, k/v repeated n_rep times; is_causal where there was no mask): a kernel that fails
    or differs keeps the call as it was."""
    key = (attend.code, *((tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device)) for t in (q, k, v)),
           None if mask is None else (tuple(mask.shape), mask.dtype), n_rep, scale, dropout_p, training)
    if key not in _CHECKED:
        _CHECKED[key] = _check(attend, q, k, v, mask, n_rep, scale, dropout_p, training)
    return _CHECKED[key]


def _check(attend, q, k, v, mask, n_rep, scale, dropout_p, training) -> str | None:
    try:
        with torch.enable_grad(), _compat.tracing(None):
            qr, kr, vr = (random_like(t).requires_grad_(training) for t in (q, k, v))
            out = attend(qr, kr, vr)
            if training:
                torch.autograd.grad(out, (qr, kr, vr), torch.randn_like(out))
            if dropout_p:
                return None
            with torch.no_grad():
                kk, vv = (t.repeat_interleave(n_rep, dim=1) for t in (kr, vr))
                ref = F.scaled_dot_product_attention(qr, kk, vv, attn_mask=mask, is_causal=mask is None, scale=scale)
    except Exception as e:  # noqa: BLE001  (any failure keeps the call as it was)
        return f"the new call failed on this signature: {type(e).__name__}: {str(e)[:200]}"
    err = ((out.detach().float() - ref.float()).norm() / ref.float().norm()).item()
    if not err <= TOLERANCE[q.dtype]:
        return f"the new call differs from the masked one on random data: relative error {err:.1e}"
    return None


def _estimate(q, k, v, mask_bytes: int, repeat_bytes: int, ctx) -> cost.Estimate:
    """Half the score tiles, no mask read (where there was a mask: every tile computed), no k/v copies
    (forward, and their reduction backward)."""
    probe = types.SimpleNamespace(tensor_inputs=lambda: [q, k, v])
    ours = cost.estimate_attention(probe, ctx, "flash_causal", 0.5)
    base = cost.estimate_attention(probe, ctx, "sdpa_mask", 1.0) if mask_bytes else ours
    extra = mask_bytes + repeat_bytes * (3 if ctx.training else 1)
    return cost.Estimate(ours.ours_s, base.ours_s + extra / ctx.profile.bandwidth, ours.ours_bytes,
                         base.ours_bytes + extra, "the call as written", f"{q.shape[-2]}x{k.shape[-2]} causal")


def _sdpa_op(replacement: fx.GraphModule) -> str:
    return next((str(n.target) for n in replacement.graph.nodes if "scaled_dot_product" in str(n.target)), "?")


def _new_call(match: Match, args: dict, mask, n_rep: int, training: bool, config) -> tuple:
    """(replacement, what failed before it, None) for the first backend order whose traced call keeps
    the region's layout and passes its check; (None, "", why each failed) when none does."""
    failures = []
    for order in _orders(val(match.inputs[0]).device):
        attend = _causal_sdpa(args.get("dropout_p", 0.0), args.get("scale"), n_rep > 1, order)
        try:
            replacement = trace_function(attend, [val(n) for n in match.inputs])
            keep_logsumexp(replacement)
        except Exception as e:  # noqa: BLE001  (the call stays as it is, with the reason)
            why = f"replacement failed to trace: {type(e).__name__}: {e}"
        else:
            why = engine.layout_change(match, replacement)
            if why is None and config.verify_kernels:
                why = _checked(replacement, *(val(n) for n in match.inputs),
                               constant_value(mask) if mask is not None else None, n_rep, args.get("scale"),
                               args.get("dropout_p", 0.0), training)
        if why is None:
            return replacement, "".join(f" ({f})" for f in failures), None
        failures.append(f"{'cuDNN first' if order else 'torch order'}: {why}")
    return None, "", "; ".join(failures)


def rewrite(gm: fx.GraphModule, config, log, gid: int, needs_grad: set) -> int:
    """Every fused SDPA call with a mask or repeated k/v: one decision row each."""
    if not config.enables(DESCRIPTOR):
        return 0
    applied = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in MASK_ARG or not node.users:
            continue
        args = _arguments(node)
        q_node, k_node, v_node = args["query"], args["key"], args["value"]
        mask = args.get(MASK_ARG[node.target])
        rep_k, rep_v = unrepeated(k_node), unrepeated(v_node)
        repeated = rep_k is not None and rep_v is not None and rep_k[1] == rep_v[1]
        if mask is None and not (args.get("is_causal") and repeated):
            continue
        q, k, v = val(q_node), val(k_node), val(v_node)
        why = _mask_rule(node, args) if mask is not None else None
        if why is None and not _uses_output_only(node):
            why = "the op's logsumexp is used besides its output"
        gqa = why is None and repeated
        inputs = [q_node, rep_k[0], rep_v[0]] if gqa else [q_node, k_node, v_node]
        ctx = cost.CostContext.of(q.device, config, node in needs_grad)
        estimate = _estimate(q, k, v, val(mask).numel() * val(mask).element_size() if mask is not None else 0,
                             2 * k.numel() * k.element_size() if gqa else 0, ctx)
        users = list(node.users)  # getitem(node, 0) each
        match = Match(DESCRIPTOR, node, inputs, users[:1], [node, *users])
        replacement, failed = None, ""
        if why is None:
            replacement, failed, why = _new_call(match, args, mask, rep_k[1] if gqa else 1, node in needs_grad,
                                                 config)
        change = ("mask -> is_causal" if mask is not None else "is_causal kept") + \
            (f"; k/v unrepeated (enable_gqa, {rep_k[1]} query heads a kv head)" if gqa else "")
        reason = why or (f"{change}; became {_sdpa_op(replacement)}{failed}; est. {estimate.ours_s * 1e6:.1f} us "
                         f"vs {estimate.baseline_s * 1e6:.1f} us as written ({estimate.ours_bytes / 2**20:.1f} vs "
                         f"{estimate.baseline_bytes / 2**20:.1f} MiB); {estimate.note}")
        log.add(Decision(gid, DESCRIPTOR.name, DESCRIPTOR.family, "rejected" if why else "applied", reason,
                         location(node), tuple(describe(t) for t in (q, k, v)),
                         bytes_saved=None if why else estimate.bytes_saved,
                         time_saved_us=None if why else round(estimate.time_saved_s * 1e6, 2),
                         kernel="sdpa is_causal"))
        if why:
            continue
        for user in users[1:]:
            user.replace_all_uses_with(users[0])
        engine.rewrite_region(gm, match, replacement, node.prev)
        applied += 1
    if applied:
        gm.recompile()
    return applied
