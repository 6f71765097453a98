"""LM head + cross-entropy, fwd+bwd: time and peak memory, ours vs eager, Inductor and Liger.

    python benchmarks/bench_loss.py [--vocab 32000 128256 256000] [--tokens 4096] [--hidden 2048]

Two cases per vocabulary, bf16, HF's spelling (logits upcast to fp32, mean over valid tokens):
  linear_ce  h (N, H) -> F.linear(h, W) -> cross-entropy          (Liger: LigerFusedLinearCrossEntropyLoss)
  ce         logits (N, V) given -> cross-entropy                  (Liger: LigerCrossEntropyLoss)
GPU time is the profiler's kernel sum; peak is the memory allocated during one fwd+bwd above what
was allocated before it (inputs and weights excluded). Each result is checked against eager first.
"""
import argparse

import torch
import torch.nn.functional as F

import fusion_compiler as fc
from common import env, save, table, time_and_peak


def linear_ce(h, w, t):
    return F.cross_entropy(F.linear(h, w).float(), t, ignore_index=-100)


def ce(x, t):
    return F.cross_entropy(x.float(), t, ignore_index=-100)


def _liger():
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss, LigerFusedLinearCrossEntropyLoss
    except ImportError as e:
        print(f"liger-kernel not importable, its rows are skipped: {e}")
        return None
    flce, lce = LigerFusedLinearCrossEntropyLoss(ignore_index=-100), LigerCrossEntropyLoss(ignore_index=-100)
    return {"linear_ce": lambda h, w, t: flce(w, h, t), "ce": lambda x, t: lce(x, t)}


def run(vocabs, tokens, hidden):
    rows = []
    liger = _liger()
    for v in vocabs:
        torch.manual_seed(0)
        h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(v, hidden, device="cuda", dtype=torch.bfloat16) / hidden ** 0.5).requires_grad_()
        x = (torch.randn(tokens, v, device="cuda", dtype=torch.bfloat16) * 2).requires_grad_()
        t = torch.randint(0, v, (tokens,), device="cuda")
        t[::7] = -100
        for case, fn, args, leaves in (("linear_ce", linear_ce, (h, w, t), (h, w)), ("ce", ce, (x, t), (x,))):
            ref_loss = fn(*args)
            ref_grads = torch.autograd.grad(ref_loss, leaves)
            be = fc.backend()
            impls = {"eager": fn, "inductor": torch.compile(fn, dynamic=False),
                     "fusion": torch.compile(fn, backend=be, dynamic=False),
                     # our kernel whatever the cost model says (it keeps the plain loss on Inductor
                     # until a measurement says otherwise)
                     "fusion_always": torch.compile(fn, backend=fc.backend(cost_model="always"), dynamic=False)}
            if liger:
                impls["liger"] = liger[case]
            for impl, f in impls.items():
                loss = f(*args)
                grads = torch.autograd.grad(loss, leaves)
                err = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(grads, ref_grads))
                row = dict(case=case, vocab=v, tokens=tokens, impl=impl, loss_diff=f"{abs(loss.item() - ref_loss.item()):.1e}",
                           grad_err=f"{err:.1e}")
                del loss, grads
                ms, peak = time_and_peak(lambda: torch.autograd.grad(f(*args), leaves))
                row.update(fwdbwd_ms=round(ms, 3), peak_GiB=round(peak, 3))
                if impl == "fusion":
                    row["fused_as"] = ",".join(d.pattern for d in be.log.decisions if d.verdict == "applied") or "-"
                rows.append(row)
                print(row, flush=True)
            torch.compiler.reset()
        del h, w, x
        torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256, 256000])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=2048)
    a = ap.parse_args()
    rows = run(a.vocab, a.tokens, a.hidden)
    save("loss.json", {"env": env(), "rows": rows})
    print(env())
    print(table(rows, ["case", "vocab", "impl", "fwdbwd_ms", "peak_GiB", "loss_diff", "grad_err", "fused_as"]))


if __name__ == "__main__":
    main()
