"""A benchmark script run with one detail of the tensorwise recipe changed in this process (ablations
of issue 7's loss gap and step time); bench_fp8.py's runs are saved with the variant's name as their
mode prefix.

    python benchmarks/fp8_variants.py VARIANT SCRIPT [its arguments]   (SCRIPT: bench_fp8.py, bench_llama_step.py)

e4m3_dy: the output gradient cast to e4m3 (max 448) instead of e5m2 (so the LM head keeps bf16, by the
    e4m3 recipes' logits rule: compare it with head_bf16, which differs from it in dy's format alone).
head_bf16: the LM head keeps bf16 (the e4m3 recipes' logits rule, patterns/fp8.py, applied to tensorwise).
fast_accum_fwd: the forward GEMM with torch._scaled_mm's use_fast_accum (torchao's default for it).
dy_bf16: the output gradient kept in 16 bits, the backward GEMMs in bf16 from the dequantized FP8 x^T and w^T,
    the LM head in bf16 as head_bf16 (so compare with head_bf16: what e5m2 dy costs the other linears).
"""
import dataclasses
import runpy
import sys

import torch

from fusion_compiler.ops import fp8 as fp8_op
from fusion_compiler.patterns import fp8 as fp8_pattern


def e4m3_dy():
    fp8_op.RECIPES["tensorwise"] = dataclasses.replace(fp8_op.RECIPES["tensorwise"], grad_dtype=torch.float8_e4m3fn)


def head_bf16():
    rule = fp8_pattern._logits_rule
    fp8_pattern._logits_rule = lambda node, recipe, training: rule(
        node, dataclasses.replace(recipe, grad_dtype=torch.float8_e4m3fn), training)


def fast_accum_fwd():
    mm = fp8_op.scaled_mm  # the forward is the one GEMM whose first operand is e4m3 (dy is e5m2)
    fp8_op.scaled_mm = lambda a, b, **kw: mm(a, b, use_fast_accum=a.dtype == torch.float8_e4m3fn, **kw)


def dy_bf16():
    head_bf16()

    def grads(dy, q, qt, scale, qx_t, x_scale, qw_t, w_scale, w, emulate, needs):
        if needs[0] and qw_t.numel() == 0:
            _, qw_t, w_scale = fp8_op.quantize_tensor(w, fp8_op.E4M3, emulate, rows=False)
        dx = dy @ (qw_t.t().float() * w_scale).to(dy.dtype) if needs[0] else dy.new_empty(0)
        dw = dy.t() @ (qx_t.t().float() * x_scale).to(dy.dtype) if needs[1] else dy.new_empty(0)
        return [dx, dw]
    fp8_op.tensorwise_grads = grads


VARIANTS = {f.__name__: f for f in (e4m3_dy, head_bf16, fast_accum_fwd, dy_bf16)}

if __name__ == "__main__":
    variant, script = sys.argv[1:3]
    VARIANTS[variant]()
    sys.argv = [script, *sys.argv[3:], *(["--mode-prefix", variant + ":"] if script == "bench_fp8.py" else [])]
    runpy.run_path(script, run_name="__main__")
