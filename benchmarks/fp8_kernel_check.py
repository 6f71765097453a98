"""FP8 linear on the GPU against the same recipe computed from torch's reference quantization
(codegen/fp8.py `quantize_reference`) with fp32 products: per shape and recipe, the SQNR (dB) of y,
dx and dW of the real op (our Triton casts + torch._scaled_mm) and of the reference, both against
bf16 eager. A kernel that quantizes wrongly at the GPU's tile sizes shows as a gap between the two.

    python fp8_kernel_check.py
"""
import math

import torch

from fusion_compiler.codegen import fp8 as kernels
from fusion_compiler.ops import fp8 as op

SHAPES = ((4096, 1024, 1024), (4096, 4096, 1024), (4096, 1024, 4096), (4096, 256, 1024))  # M, N, K


def sqnr(a, ref) -> float:
    a, ref = a.double(), ref.double()
    noise = (a - ref).pow(2).sum().item()
    return math.inf if noise == 0 else round(10 * math.log10(ref.pow(2).sum().item() / noise), 2)


def grads(x, w, dy, fn):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = fn(x, w)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    return y, dx, dw


def main():
    torch.manual_seed(0)
    for m, n, k in SHAPES:
        # activations with outlier rows/columns and a heavy-tailed gradient, as in training
        x = (torch.randn(m, k, device="cuda") * torch.rand(m, 1, device="cuda") * 4).to(torch.bfloat16)
        w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
        dy = (torch.randn(m, n, device="cuda") * torch.rand(m, 1, device="cuda") ** 4 * 1e-3).to(torch.bfloat16)
        ref = grads(x, w, dy, lambda a, b: a @ b.t())
        for recipe in ("rowwise", "tensorwise"):
            real = grads(x, w, dy, lambda a, b: op.linear(a, b, recipe, False))
            emulated = grads(x, w, dy, lambda a, b: op.linear(a, b, recipe, True))
            saved = kernels.quantize, kernels.quantize_tensorwise
            kernels.quantize, kernels.quantize_tensorwise = kernels.quantize_reference, kernels.quantize_tensorwise_reference
            try:
                torch_ref = grads(x, w, dy, lambda a, b: op.linear(a, b, recipe, True))
            finally:
                kernels.quantize, kernels.quantize_tensorwise = saved
            row = {"shape": f"{m}x{n}x{k}", "recipe": recipe}
            for name, got in (("real", real), ("emulated", emulated), ("torch_quant", torch_ref)):
                row[name] = [sqnr(a, b) for a, b in zip(got, ref)]
            print(row, flush=True)


if __name__ == "__main__":
    main()
