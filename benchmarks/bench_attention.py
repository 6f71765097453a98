"""Hand-written attention, fwd+bwd: eager vs Inductor vs fusion, against the fused call a user would
write by hand (SDPA, or FlexAttention for what SDPA cannot express).

    python benchmarks/bench_attention.py [--seq 512 2048 8192] [--spellings ...] [--device cpu]
Spellings: causal triu, HF eager, no mask, nanoGPT buffer, soft-cap, sliding window, einsum, bmm on
flattened heads, torch.where + tril, ALiBi (dropout is not timed: its output is random).
B4 H16 D128 bf16 at S <= 2048 (the anchors' shape at 2048), 8192 // S sequences beyond. GPU time
(profiler kernel sum) and the peak memory of one fwd+bwd above the inputs; every implementation's
output is checked against the reference first (rel_err), and its q/k/v gradients too (grad_err).
"""
import argparse
import functools
import math

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import fusion_compiler as fc
from common import env, save, table, time_and_peak

WINDOW = 256  # sliding-window span (keys i - WINDOW < j <= i)
CAP = 30.0  # logit soft-cap (Gemma 2 uses 50 for attention; the anchors measured 30)


def _causal_masked(n, device):
    return torch.triu(torch.ones(n, n, dtype=torch.bool, device=device), diagonal=1)


def causal_triu(q, k, v):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    return torch.softmax(s.masked_fill(_causal_masked(q.size(-2), q.device), float("-inf")), -1) @ v


def hf_eager(q, k, v):
    """HF eager attention: fp32 softmax; the additive causal mask built in the graph from arange."""
    i = torch.arange(q.size(-2), device=q.device)
    mask = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(i[None, :] > i[:, None],
                                                                       torch.finfo(q.dtype).min)
    w = torch.matmul(q, k.transpose(2, 3)) * q.size(-1) ** -0.5 + mask[None, None]
    return torch.matmul(torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)


def no_mask(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) * q.size(-1) ** -0.5, -1) @ v


def einsum_causal(q, k, v):
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.size(-1))
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s.masked_fill(_causal_masked(q.size(-2), q.device),
                                                                        float("-inf")), -1), v)


def bmm_flat_causal(q, k, v):
    b, h, n, d = q.shape
    qf, kf, vf = (t.reshape(b * h, n, d) for t in (q, k, v))
    s = (torch.bmm(qf, kf.transpose(1, 2)) * d ** -0.5).masked_fill(_causal_masked(n, q.device), float("-inf"))
    return torch.bmm(torch.softmax(s, -1), vf).view(b, h, n, d)


def where_tril_causal(q, k, v):
    keep = torch.tril(torch.ones(q.size(-2), q.size(-2), dtype=torch.bool, device=q.device))
    return torch.softmax(torch.where(keep, q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), float("-inf")), -1) @ v


def _alibi(n, heads, device):
    slopes = 2.0 ** (-8.0 * torch.arange(1, heads + 1, device=device) / heads)
    i = torch.arange(n, device=device)
    bias = -(i[:, None] - i[None, :]).clamp(min=0).float() * slopes[:, None, None]
    return bias.masked_fill(i[None, :] > i[:, None], float("-inf"))[None]


def alibi_causal(q, k, v):
    """ALiBi: a per-head linear bias plus causality, built in the graph (an additive mask for SDPA)."""
    s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) + _alibi(q.size(-2), q.size(1), q.device).to(q.dtype)
    return torch.softmax(s, -1) @ v


_BUFFERS = {}


def nanogpt_buffer(q, k, v):
    """nanoGPT: a registered tril buffer sliced to the length (a graph input, not a constant)."""
    t = q.size(-2)
    bias = _BUFFERS[q.device]
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
    return torch.softmax(att.masked_fill(bias[:, :, :t, :t] == 0, float("-inf")), -1) @ v


def softcap_causal(q, k, v):
    s = torch.tanh(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)) / CAP) * CAP
    return torch.softmax(s.masked_fill(_causal_masked(q.size(-2), q.device), float("-inf")), -1) @ v


def sliding_window(q, k, v):
    i = torch.arange(q.size(-2), device=q.device)
    far = (i[None, :] > i[:, None]) | (i[:, None] - i[None, :] >= WINDOW)
    s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    return torch.softmax(s.masked_fill(far, float("-inf")), -1) @ v


# --- hand-written references ---------------------------------------------------------------------------
def _sdpa(causal):
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


def _flex_ref(mask_mod, score_mod=None):
    def ref(q, k, v):
        n = q.size(-2)
        block = create_block_mask(mask_mod, None, None, n, n, device=q.device)
        return _compiled_flex()(q, k, v, score_mod=score_mod, block_mask=block)
    return ref


def _flex_from_buffer(q, k, v):
    """What FlexAttention would give nanoGPT's buffer: a block mask reduced from it at every call."""
    from fusion_compiler.patterns.block_masks import dense_block_mask
    t = q.size(-2)
    block = dense_block_mask(_BUFFERS[q.device][:, :, :t, :t] != 0, q.size(0), q.size(1))
    return flex_attention(q, k, v, block_mask=block)


def _softcap(s, b, h, qi, ki):
    return torch.tanh(s / CAP) * CAP


def _causal(b, h, qi, ki):
    return qi >= ki


def _window(b, h, qi, ki):
    return (qi >= ki) & (qi - ki < WINDOW)


# name: (spelling, reference name, reference, fraction of the score tiles the reference computes)
SPELLINGS = {
    "causal_triu": (causal_triu, "sdpa", _sdpa(True), 0.5),
    "hf_eager_causal": (hf_eager, "sdpa", _sdpa(True), 0.5),
    "no_mask": (no_mask, "sdpa", _sdpa(False), 1.0),
    "nanogpt_buffer": (nanogpt_buffer, "sdpa", _sdpa(True), 0.5),
    "softcap_causal": (softcap_causal, "flex", _flex_ref(_causal, _softcap), 0.5),
    "sliding_window": (sliding_window, "flex", _flex_ref(_window), None),
    "einsum_causal": (einsum_causal, "sdpa", _sdpa(True), 0.5),
    "bmm_flat_causal": (bmm_flat_causal, "sdpa", _sdpa(True), 0.5),
    "where_tril_causal": (where_tril_causal, "sdpa", _sdpa(True), 0.5),
    "alibi_causal": (alibi_causal, "sdpa_alibi", lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, attn_mask=_alibi(q.size(-2), q.size(1), q.device).to(q.dtype)), 1.0),
}

DEV = "cuda"


def _err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _measure(name, impl, f, q, k, v, g, ref_out, ref_grads, flops):
    out = f(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), g)
    row = dict(spelling=name, seq=q.size(-2), batch=q.size(0), impl=impl, rel_err=f"{_err(out, ref_out):.1e}",
               grad_err=f"{max(_err(a, b) for a, b in zip(grads, ref_grads)):.1e}")
    del out, grads
    if DEV == "cpu":
        return row

    ms, peak = time_and_peak(lambda: torch.autograd.grad(f(q, k, v), (q, k, v), g))
    row.update(fwdbwd_ms=round(ms, 3), TFLOPs=round(flops / ms / 1e9), extra_peak_GiB=round(peak, 3))
    return row


def run(seqs, names, heads=16, dim=128):
    rows = []
    for s in seqs:
        b = max(1, 8192 // s) if s > 2048 else 4
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, heads, s, dim, device=DEV, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        g = torch.randn_like(q)
        _BUFFERS[q.device] = torch.tril(torch.ones(s, s, device=DEV)).view(1, 1, s, s)
        for name in names:
            fn, ref_name, ref, density = SPELLINGS[name]
            if density is None:  # the window's share of the tiles, as FlexAttention computes them
                density = min(1.0, (WINDOW + 128) / s)
            flops = 4 * b * heads * s * s * dim * 3.5 * density
            ref_out = ref(q, k, v)
            ref_grads = torch.autograd.grad(ref_out, (q, k, v), g)
            be = fc.backend()
            impls = {ref_name: ref, "eager": fn, "inductor": torch.compile(fn, dynamic=False),
                     "fusion": torch.compile(fn, backend=be, dynamic=False)}
            if name == "nanogpt_buffer" and DEV != "cpu":
                impls["flex_from_buffer"] = torch.compile(_flex_from_buffer, dynamic=False)
            for impl, f in impls.items():
                if impl == "eager" and s > 4096:
                    continue  # eager's S x S scores at 8192 take minutes to time
                rows.append(_measure(name, impl, f, q, k, v, g, ref_out, ref_grads, flops))
                if impl == "fusion":
                    applied = [d for d in be.log.decisions if d.verdict == "applied"]
                    rows[-1]["fused_as"] = ",".join(sorted({d.pattern for d in applied})) or "-"
                    rows[-1]["decisions"] = [f"{d.pattern}: {d.verdict}: {d.reason[:160]}" for d in be.log.decisions]
                print(rows[-1], flush=True)
            torch.compiler.reset()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, nargs="+", default=[2048])
    ap.add_argument("--spellings", nargs="+", default=list(SPELLINGS))
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (no timings)")
    a = ap.parse_args()
    global DEV
    DEV = a.device
    rows = run(a.seq, a.spellings)
    save("attention.json", {"env": env(), "rows": rows})
    print(env())
    print(table(rows, ["spelling", "seq", "batch", "impl", "fwdbwd_ms", "TFLOPs", "extra_peak_GiB", "rel_err",
                       "grad_err", "fused_as"]))


if __name__ == "__main__":
    main()
