"""Per-row FP8 casts of linear inputs that Inductor makes: the cast as torch ops Inductor fuses into the
producing kernel (FusionConfig(fp8_fuse_cast=True), patterns/fp8.py) against each linear casting its
input with our kernel (fp8_fuse_cast=False), bf16 under Inductor beside them. Producers: attention's
heads transposed back and made contiguous (HF's eager attention before o_proj), a LayerNorm, a tanh
GELU and an RMSNorm spelled in torch ops, each feeding a bias-free linear. bf16, training; GPU ms
(the profiler's kernel sum) of the forward alone and of forward + backward, kernels per forward, and
the relative difference of y and dx between the two casts. (Stop 39 ran it with a LayerNorm's output
cast in Inductor's kernel too; that was slower, so a LayerNorm now keeps our cast in both modes.)

    python benchmarks/fp8_inductor_cast.py
"""
import torch
import torch.nn.functional as F

import fusion_compiler as fc
from common import bench_gpu_ms, env, kernels_ms, save, table


class Producer(torch.nn.Module):
    def __init__(self, kind: str, k: int, n: int):
        super().__init__()
        self.kind, self.norm = kind, torch.nn.LayerNorm(k)
        self.weight = torch.nn.Parameter(torch.randn(k) * 0.1 + 1)
        self.linear = torch.nn.Linear(k, n, bias=False)

    def forward(self, t):
        if self.kind == "attention copy":  # t: [batch, heads, seq, head_dim]
            x = t.transpose(1, 2).reshape(t.shape[0] * t.shape[2], -1)
        elif self.kind == "layer_norm":
            x = self.norm(t)
        elif self.kind == "gelu_tanh":
            x = F.gelu(t, approximate="tanh")
        else:  # rms_norm in torch ops
            tf = t.float()
            x = (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(t.dtype) * self.weight
        return self.linear(x)


CASES = (("attention copy", (2, 16, 2048, 128), 2048, 2048), ("layer_norm", (4096, 2048), 2048, 8192),
         ("gelu_tanh", (4096, 8192), 8192, 2048), ("rms_norm", (8192, 4096), 4096, 4096))


def main():
    rows, notes = [], {}
    for kind, shape, k, n in CASES:
        torch.manual_seed(0)
        module = Producer(kind, k, n).cuda().to(torch.bfloat16)
        t = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(t.numel() // k, n, device="cuda", dtype=torch.bfloat16)
        got = {}
        for mode in ("bf16", "fp8, our cast", "fp8, cast in Inductor's kernel"):
            torch.compiler.reset()
            be = "inductor" if mode == "bf16" else fc.backend(fp8="rowwise", cost_model="always", families={"fp8"},
                                                              fp8_fuse_cast=mode.endswith("kernel"))
            fwd = torch.compile(module, backend=be)
            x = t.detach().clone().requires_grad_()

            def step():
                y = fwd(x)
                y.backward(dy)
                return y
            y = step()
            got[mode] = y_now, dx_now = y.detach().float(), x.grad.float()  # before the timed steps add to x.grad
            fwd_ms, step_ms = bench_gpu_ms(lambda: fwd(x)), bench_gpu_ms(step)
            launches = sum(count for _, _, count in kernels_ms(lambda: fwd(x), top=100))
            row = dict(producer=kind, shape="x".join(map(str, shape)), mode=mode, fwd_ms=round(fwd_ms, 4),
                       step_ms=round(step_ms, 4), kernels_fwd=launches)
            if mode != "bf16":
                notes[(kind, mode)] = [d.reason for d in be.log.decisions if d.pattern == "fp8_linear"]
                ref_y, ref_dx = got["bf16"]
                row["y_vs_bf16"] = round(((y_now - ref_y).norm() / ref_y.norm()).item(), 4)
                row["dx_vs_bf16"] = round(((dx_now - ref_dx).norm() / ref_dx.norm()).item(), 4)
            if mode.endswith("kernel"):
                (a_y, a_dx), (b_y, b_dx) = got["fp8, our cast"], got[mode]
                row["y_vs_our_cast"] = round(((b_y - a_y).norm() / a_y.norm()).item(), 6)
                row["dx_vs_our_cast"] = round(((b_dx - a_dx).norm() / a_dx.norm()).item(), 6)
            rows.append(row)
            print(row, flush=True)
    for key, reasons in notes.items():
        print(key, reasons[0][-200:] if reasons else "no FP8 linear")
    save("fp8-inductor-cast.json", {"env": env(), "rows": rows,
                                    "notes": {" / ".join(k): v for k, v in notes.items()}})
    print(env())
    print(table(rows, ["producer", "mode", "fwd_ms", "step_ms", "kernels_fwd", "y_vs_bf16", "dx_vs_bf16",
                       "y_vs_our_cast", "dx_vs_our_cast"]))


if __name__ == "__main__":
    main()
