"""Our tensorwise FP8 linear against torchao's Float8Linear (its default recipe: per-tensor scales,
e4m3 x and w, e5m2 dy) on the same operands: how many elements of y, dx and dW are equal, and the
relative distance between the two (against their distance from the fp32 product, the FP8 error itself).

    python fp8_torchao_check.py          (torchao on the path: a carried wheel on the GPU machine)

On CUDA both run their real kernels: our casts + torch._scaled_mm against torchao's casts under its
own GEMM settings (its forward uses fast accumulation, ours does not). Elsewhere both emulate the
recipe (ours: FusionConfig(fp8_emulate=True)'s op with the interpreter's kernels, TRITON_INTERPRET=1;
torchao: Float8LinearConfig(emulate=True)).
"""
import torch

from fusion_compiler.ops import fp8 as op

SHAPES = ((256, 320, 384), (1000, 1024, 1024), (4096, 256, 1024))  # M, N, K


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    print(f"{'M x N x K':>18} {'tensor':>6} {'equal':>8} {'ours vs torchao':>16} {'torchao vs fp32':>16}")
    for m, n, k in SHAPES:
        x = (torch.randn(m, k, device=device) * torch.rand(m, 1, device=device) * 4).to(torch.bfloat16)
        w = (torch.randn(n, k, device=device) / k ** 0.5).to(torch.bfloat16)
        dy = (torch.randn(m, n, device=device) * torch.rand(m, 1, device=device) ** 4 * 1e-3).to(torch.bfloat16)
        lin = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
        lin.weight.data.copy_(w)
        ao = convert_to_float8_training(torch.nn.Sequential(lin), config=Float8LinearConfig(emulate=not cuda))
        xa = x.clone().requires_grad_()
        ya = ao(xa)
        ya.backward(dy)
        xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
        yb = op.linear(xb, wb, "tensorwise", not cuda)
        yb.backward(dy)
        exact = {"y": x.float() @ w.float().t(), "dx": dy.float() @ w.float(), "dW": dy.float().t() @ x.float()}
        for name, ours, theirs in (("y", yb, ya), ("dx", xb.grad, xa.grad), ("dW", wb.grad, lin.weight.grad)):
            print(f"{f'{m} x {n} x {k}':>18} {name:>6} {(ours == theirs).float().mean().item():8.4%} "
                  f"{rel(ours, theirs):16.2e} {rel(theirs, exact[name]):16.2e}")


if __name__ == "__main__":
    main()
