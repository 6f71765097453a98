"""FP8 linears: the op alone against bf16 (fwd and fwd+bwd, quantization included), and a loss curve.

    python benchmarks/bench_fp8.py [--parts linear train quantize head_loss] [--steps 300] [--train-modes bf16 bf16_eager fp8_rowwise]
                                   [--repeats 3] [--summarize FILES]

linear: x [M, K] @ w [N, K]^T in bf16 (cuBLAS, as F.linear and Inductor run it) and as
fusion::fp8_linear with each recipe, at 4096^3, 8192^3 and the Llama-8B MLP (8192 tokens, 4096 ->
14336 and 14336 -> 4096). GPU time: the profiler's kernel sum per call; SQNR of y, dx, dW against the
bf16 results (dB). Also the bare torch._scaled_mm rate at 8192^3 (the cost model's figure).
quantize: the quantization kernel alone against Inductor's, the kernels of one FP8 linear, and an
RMSNorm followed by the cast (two kernels, one, Inductor's); GB/s count 2 bytes read and 1 written an
element (the norm: 2 read, 2 + 1 written).
head_loss: the reference step's LM head + cross-entropy (4096 x 2048 -> 128256, logits returned)
fwd+bwd: bf16 Inductor, the FP8 head beside Inductor's loss, and the two fused (patterns/fp8_loss.py).
train: a small Llama (8 layers, hidden 1024, ffn 4096, 8 x 512 tokens) trained `--steps`
steps with AdamW (peak lr 1e-3; --schedule cosine: linear warm-up over the first 10% of the steps, then
cosine decay to 10% of the peak, as LLM pre-training runs; constant: lr 1e-3 throughout, the protocol of
the runs before stop 22) from one seed, on `--data`: bigram, a fixed random bigram language (vocab
2048, 8 successors per token), or text, real text: the bytes of the installed torch package's Python
sources (vocab 256, windows at seeded random offsets); bf16 under Inductor against every
linear in FP8 (rowwise, the cost model off; the LM head stays in bf16 under recipes with e4m3
gradients, patterns/fp8.py; --train-modes: others, and bf16 in eager, whose distance from the
Inductor curve is what rounding alone does), the losses saved for the plot (plot_fp8.py). Every mode
sees the same batches in the same order. Runs from the same seed still differ (kernels with atomics:
at stop 30 the final loss had a spread of 0.75% sd for bf16 and 1.5% for FP8), so each mode runs
`--repeats` times (3 by default), interleaved, and the means are compared. `--summarize FILES` pools the
runs of earlier files (several processes sharing one GPU, fp8_variants.py's ablations) by mode.
"""
import argparse
import json
import math
import os
import statistics

import torch
import torch.nn.functional as F

import fusion_compiler as fc
from common import bench_gpu_ms, env, kernels_ms, save, table, torchao_float8
from fusion_compiler.ops import fp8 as fp8_op

SHAPES = {"4096^3": (4096, 4096, 4096), "8192^3": (8192, 8192, 8192), "llama8b_up": (8192, 14336, 4096),
          "llama8b_down": (8192, 4096, 14336)}


def sqnr(a, ref) -> float:
    a, ref = a.double(), ref.double()
    noise = (a - ref).pow(2).sum()
    return round(10 * math.log10(ref.pow(2).sum().item() / noise.item()), 1) if noise > 0 else float("inf")


def linear_rows() -> list:
    rows = []
    for name, (m, n, k) in SHAPES.items():
        torch.manual_seed(0)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16).requires_grad_()
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, w)
        ref_dx, ref_dw = torch.autograd.grad(ref, [x, w], dy)
        flops = 2.0 * m * n * k
        impls = {"bf16": lambda: F.linear(x, w)}
        for recipe in ("tensorwise", "rowwise", "rowwise_gw_hp"):
            impls[f"fp8_{recipe}"] = (lambda r: lambda: fp8_op.linear(x, w, r, False))(recipe)
        for label, fn in impls.items():
            y = fn()
            dx, dw = torch.autograd.grad(y, [x, w], dy)
            with torch.no_grad():
                fwd = bench_gpu_ms(fn)

            def step():
                torch.autograd.grad(fn(), [x, w], dy)
            both = bench_gpu_ms(step)
            row = dict(shape=name, impl=label, fwd_ms=round(fwd, 3), fwdbwd_ms=round(both, 3),
                       fwd_tflops=round(flops / fwd / 1e9), fwdbwd_tflops=round(3 * flops / both / 1e9),
                       sqnr_y=sqnr(y, ref), sqnr_dx=sqnr(dx, ref_dx), sqnr_dw=sqnr(dw, ref_dw))
            rows.append(row)
            print(json.dumps(row), flush=True)
    base = {r["shape"]: r for r in rows if r["impl"] == "bf16"}
    for r in rows:
        r["fwd_x"] = round(base[r["shape"]]["fwd_ms"] / r["fwd_ms"], 2)
        r["fwdbwd_x"] = round(base[r["shape"]]["fwdbwd_ms"] / r["fwdbwd_ms"], 2)
    return rows


def quantize_rows() -> list:
    """The quantization kernels alone against Inductor compiling the same math from torch ops, on the
    reference Llama step's operands: per-row scales (codegen/fp8.quantize, row-major and transposed:
    the backward's layouts; GB/s counts 2 bytes read and 1 written an element) and a per-tensor scale
    (quantize_tensorwise, both layouts from one cast: 2 + 2 read (the amax pass), 1 + 1 written)."""
    from fusion_compiler.codegen import fp8 as kernels
    rows = []
    e4m3 = torch.float8_e4m3fn
    inductor = {"row": torch.compile(kernels.quantize_reference),
                "tensor": torch.compile(kernels.quantize_tensorwise_reference)}
    ours = {"row": kernels.quantize, "tensor": kernels.quantize_tensorwise}
    for r, c in ((4096, 2048), (4096, 8192), (8192, 2048), (4096, 128256)):
        base = torch.randn(r, c, device="cuda", dtype=torch.bfloat16)
        for layout, t, scale in (("rows", base, "row"), ("transposed", base.t(), "row"), ("both", base, "tensor")):
            got, want = ours[scale](t, e4m3), inductor[scale](t, e4m3)  # checked before they are timed
            (q, inv), (ref_q, ref_inv) = (got[::2], want[::2]) if scale == "tensor" else (got, want)
            if scale == "tensor":
                assert torch.equal(got[1].float(), q.float().t())
            deq, ref_deq = q.float() * inv, ref_q.float() * ref_inv
            assert torch.allclose(inv, ref_inv, rtol=1e-6) and q.is_contiguous() and q.shape == t.shape
            step = 2.0 ** -3 * ref_deq.abs() + 2.0 ** -9 * ref_inv  # one e4m3 step (subnormal: absolute)
            assert ((deq - ref_deq).abs() <= step * 1.001).all(), (layout, scale)
            moved = 3 * r * c if scale == "row" else 6 * r * c
            for impl, fn in (("ours", ours[scale]), ("inductor", inductor[scale])):
                ms = bench_gpu_ms(lambda: fn(t, e4m3))
                row = dict(shape=f"{tuple(t.shape)}", layout=layout, scale=scale, impl=impl, ms=round(ms, 4),
                           gbps=round(moved / ms / 1e6))
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def producer_cast_rows() -> list:
    """Kernels whose output feeds FP8 linears (RMSNorm; the GLU before the down projection): ours then
    our cast (two kernels), ours writing the FP8 copy itself (fusion::rms_norm_fp8, fusion::glu_fp8),
    and Inductor compiling the op + cast from torch ops. GB/s count each kernel's bytes once (the
    reads, y, its FP8 copy)."""
    from fusion_compiler.codegen import fp8 as kernels
    rows = []

    def cast(y):
        return kernels.quantize_reference(y.view(-1, y.shape[-1]), torch.float8_e4m3fn)
    norm_math = torch.compile(lambda x, w: (lambda y: (y, *cast(y)))(F.rms_norm(x, (x.shape[-1],), w, 1e-6)))
    glu_math = torch.compile(lambda g, u: (lambda y: (y, *cast(y)))(F.silu(g) * u))
    for m, n in ((4096, 2048), (8192, 4096)):
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(n, device="cuda", dtype=torch.bfloat16) + 0.5
        impls = {"norm + cast (ours, 2 kernels)": lambda: kernels.quantize(torch.ops.fusion.rms_norm(x, w, 1e-6)[0],
                                                                           torch.float8_e4m3fn),
                 "rms_norm_fp8 (ours, 1 kernel)": lambda: torch.ops.fusion.rms_norm_fp8(x, w, 1e-6),
                 "inductor (norm + cast)": lambda: norm_math(x, w)}
        rows += _timed_rows(impls, f"{m}x{n}", m * n * (2 + 2 + 1))
    for m, n in ((4096, 8192), (8192, 14336)):
        g, u = (torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        impls = {"glu + cast (ours, 2 kernels)": lambda: kernels.quantize(torch.ops.fusion.glu(g, u, "silu"),
                                                                          torch.float8_e4m3fn),
                 "glu_fp8 (ours, 1 kernel)": lambda: torch.ops.fusion.glu_fp8(g, u, "silu"),
                 "inductor (silu(g) * u + cast)": lambda: glu_math(g, u)}
        rows += _timed_rows(impls, f"glu {m}x{n}", m * n * (2 + 2 + 2 + 1))
    return rows


def _timed_rows(impls: dict, shape: str, nbytes: int) -> list:
    rows = []
    for impl, fn in impls.items():
        ms = bench_gpu_ms(fn)
        row = dict(shape=shape, impl=impl, ms=round(ms, 4), gbps=round(nbytes / ms / 1e6))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def breakdown(m=4096, n=8192, k=2048, recipe="rowwise") -> list:
    """The kernels of one fp8_linear forward + backward at the reference Llama step's MLP shape."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    rows = []
    for impl, fn in (("bf16", lambda: F.linear(x, w)), ("fp8", lambda: fp8_op.linear(x, w, recipe, False))):
        for name, ms, calls in kernels_ms(lambda: torch.autograd.grad(fn(), [x, w], dy), top=12):
            rows.append(dict(impl=impl, kernel=name[:70], ms=ms, calls=calls))
    return rows


def head_loss_rows(m=4096, k=2048, v=128256) -> list:
    """The reference Llama step's LM head and loss (logits returned, as HF does, and the loss
    differentiated), fwd+bwd under torch.compile: bf16 Inductor, the FP8 head with Inductor's
    cross-entropy (the fusion backend with the loss fusion of patterns/fp8_loss.py off), and the fused
    op; the kernels of each (profiler)."""
    from fusion_compiler.patterns import fp8_loss

    def head(h, w, t):
        logits = F.linear(h, w)
        return logits, F.cross_entropy(logits.float(), t)
    h = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(v, k, device="cuda") / k ** 0.5).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, v, (m,), device="cuda")
    fuse, rows, grads = fp8_loss.fuse, [], {}
    for impl in ("bf16 inductor", "fp8 + inductor loss", "fp8 fused loss"):
        torch.compiler.reset()
        be = "inductor" if impl.startswith("bf16") else fc.backend(fp8="tensorwise", cost_model="always",
                                                                   families={"fp8"})
        fp8_loss.fuse = fuse if impl == "fp8 fused loss" else (lambda gm, call, config: (call, None))
        fn = torch.compile(head, backend=be)

        def step():
            return torch.autograd.grad(fn(h, w, t)[1], [h, w])
        grads[impl] = step()
        ms = bench_gpu_ms(step)
        rows.append(dict(impl=impl, kernel="(all)", ms=round(ms, 3), calls=""))
        print(json.dumps(rows[-1]), flush=True)
        for name, kms, calls in kernels_ms(step, top=8):
            rows.append(dict(impl=impl, kernel=name[:70], ms=kms, calls=calls))
    fp8_loss.fuse = fuse
    ref = grads["bf16 inductor"]
    for impl in ("fp8 + inductor loss", "fp8 fused loss"):
        rows.append(dict(impl=impl, kernel="SQNR dh / dW vs bf16 (dB)",
                         ms=" / ".join(str(sqnr(g, r)) for g, r in zip(grads[impl], ref)), calls=""))
    return rows


def scaled_mm_rate() -> float:
    from fusion_compiler._compat import scaled_mm
    a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    ms = bench_gpu_ms(lambda: scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    return 2 * 8192 ** 3 / ms / 1e9


def bigram_batches(steps: int, batch=8, seq=512, vocab=2048, fan_out=8, seed=0):
    """Token sequences from one fixed random bigram table (each token picks its successor among
    `fan_out`): the best loss is ln(fan_out) = 2.08, a unigram model's ln(vocab) = 7.62."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, fan_out), device="cuda", generator=g)
    for _ in range(steps):
        ids = torch.empty(batch, seq, dtype=torch.long, device="cuda")
        ids[:, 0] = torch.randint(0, vocab, (batch,), device="cuda", generator=g)
        choice = torch.randint(0, fan_out, (batch, seq), device="cuda", generator=g)
        for t in range(1, seq):
            ids[:, t] = successors[ids[:, t - 1], choice[:, t]]
        yield ids


def text_corpus() -> torch.Tensor:
    """The bytes of the installed torch package's .py files (sorted paths), as a uint8 CUDA tensor."""
    root = os.path.dirname(torch.__file__)
    paths = sorted(os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f.endswith(".py"))
    chunks = []
    for path in paths:
        with open(path, "rb") as f:
            chunks.append(f.read())
    return torch.frombuffer(bytearray(b"\n".join(chunks)), dtype=torch.uint8).to("cuda")


def text_batches(steps: int, corpus: torch.Tensor, batch=8, seq=512, seed=0):
    """Windows of `seq` bytes of the corpus at random offsets (one generator: the same for every mode)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    span = torch.arange(seq, device="cuda")
    for _ in range(steps):
        start = torch.randint(0, corpus.numel() - seq, (batch, 1), device="cuda", generator=g)
        yield corpus[start + span].long()


def lr_factor(step: int, steps: int, schedule: str) -> float:
    """The learning rate of `step` (0-based) as a fraction of the peak."""
    warm = max(1, steps // 10)
    if schedule == "constant":
        return 1.0
    if step < warm:
        return (step + 1) / warm
    return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm - 1)))


def train(mode: str, steps: int, schedule: str = "cosine", layers: int = 8, lr: float = 1e-3,
          data: str = "bigram") -> list:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256 if data == "text" else 2048, hidden_size=1024, intermediate_size=4096,
                      num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                      max_position_embeddings=1024, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: lr_factor(i, steps, schedule))
    if mode == "bf16_eager":  # the same math with eager's kernels: how far rounding alone moves the curve
        fwd, be = model, None
    elif mode.startswith("torchao_"):  # the peer: every nn.Linear swapped for torchao's, then Inductor
        fwd, be = torch.compile(torchao_float8(model, mode[len("torchao_"):])), None
    else:
        be = "inductor" if mode == "bf16" else fc.backend(fp8=mode[len("fp8_"):], cost_model="always",
                                                          families={"fp8"})
        fwd = torch.compile(model, backend=be)
    losses = []
    batches = text_batches(steps, text_corpus()) if data == "text" else bigram_batches(steps)
    for ids in batches:
        loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    if isinstance(be, fc.FusionBackend):
        print(fc.Report(be.log.decisions).summary(), flush=True)
    return losses


def summarize(payloads: dict) -> None:
    """The final loss (mean of the last 20 steps) of each run in the payloads, by mode (a mode's name
    is prefixed with its file's `mode_prefix`, when it has one): mean, sd, and the mean's distance
    from bf16's of the same prefix."""
    runs = {}
    for payload in payloads.values():
        for key, losses in payload["train"].items():
            runs.setdefault(payload.get("mode_prefix", "") + key.split("#")[0], []).append(sum(losses[-20:]) / 20)
    for mode, tails in runs.items():
        prefix = mode[:mode.rfind(":") + 1]
        base = statistics.mean(runs[prefix + "bf16"]) if prefix + "bf16" in runs else None
        mean = statistics.mean(tails)
        sd = statistics.stdev(tails) / mean * 100 if len(tails) > 1 else float("nan")
        vs = f" ({(mean / base - 1) * 100:+.2f}% vs bf16)" if base else ""
        print(f"final loss (mean of last 20, {len(tails)} runs) {mode}: {mean:.4f}{vs}, sd {sd:.2f}%; "
              f"runs {' '.join(f'{t:.4f}' for t in tails)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", nargs="+", default=["linear", "train"])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--schedule", choices=["cosine", "constant"], default="cosine")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3, help="the peak learning rate")
    ap.add_argument("--data", choices=["bigram", "text"], default="bigram")
    ap.add_argument("--train-modes", nargs="+", default=["bf16", "fp8_rowwise"],
                    help="bf16 (Inductor), bf16_eager, fp8_<recipe> (every linear in FP8 with that recipe), "
                         "torchao_<recipe> (torchao's Float8Linear for every linear, under Inductor)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each mode from the same seed (kernels with atomics make runs differ)")
    ap.add_argument("--summarize", nargs="+", default=[],
                    help="also pool the train runs saved in these files (BENCH_NAME of earlier runs) by mode")
    ap.add_argument("--mode-prefix", default="",
                    help="saved with the runs: names a variant of the code that ran them, for --summarize")
    args = ap.parse_args()
    payload = {"env": env()}
    if "quantize" in args.parts:
        payload["quantize"] = quantize_rows()
        payload["breakdown"] = breakdown()
        payload["producer_cast"] = producer_cast_rows()
        save(os.environ.get("BENCH_NAME", "fp8.json"), payload)
        print(table(payload["breakdown"], ["impl", "kernel", "ms", "calls"]))
        print(table(payload["quantize"], ["shape", "layout", "scale", "impl", "ms", "gbps"]))
        print(table(payload["producer_cast"], ["shape", "impl", "ms", "gbps"]))
    if "head_loss" in args.parts:
        payload["head_loss"] = head_loss_rows()
        save(os.environ.get("BENCH_NAME", "fp8.json"), payload)
        print(table(payload["head_loss"], ["impl", "kernel", "ms", "calls"]))
    if "linear" in args.parts:
        payload["scaled_mm_tflops_8192"] = round(scaled_mm_rate(), 1)
        print("scaled_mm 8192^3:", payload["scaled_mm_tflops_8192"], "TFLOP/s", flush=True)
        payload["linear"] = linear_rows()
        save(os.environ.get("BENCH_NAME", "fp8.json"), payload)
    if "train" in args.parts:
        payload["train"] = {}
        for i in range(args.repeats):  # modes interleaved; saved after each run (a run cut short keeps the rest)
            for mode in args.train_modes:
                key = mode if i == 0 else f"{mode}#{i + 1}"
                payload["train"][key] = train(mode, args.steps, args.schedule, args.layers, args.lr, args.data)
                payload.update(schedule=args.schedule, layers=args.layers, lr=args.lr, data=args.data,
                               mode_prefix=args.mode_prefix)
                save(os.environ.get("BENCH_NAME", "fp8.json"), payload)
        summarize({"": payload})
    if args.summarize:
        summarize({name: json.load(open(name)) for name in args.summarize})
    if "linear" in payload:
        print(table(payload["linear"], ["shape", "impl", "fwd_ms", "fwdbwd_ms", "fwd_x", "fwdbwd_x", "fwd_tflops",
                                        "fwdbwd_tflops", "sqnr_y", "sqnr_dx", "sqnr_dw"]))


if __name__ == "__main__":
    main()
