"""Tiles of the FP8 casts (codegen/fp8.py), GPU ms per cast, the best first, on the reference Llama
step's operands:
- quantize_strided (per-row scales of a transposed operand: the backward's x^T, dy^T, w^T): every
  (BLOCK_R, BLOCK_C, CHUNK, warps), amax pass + cast;
- quantize_tensorwise (a per-tensor scale, q and q^T from one cast): every (BLOCK_R, BLOCK_C, warps)
  of the cast tiles, amax pass + cast;
- grad_cast (the FP8 LM head's loss gradient written in e5m2, both layouts, codegen/fp8_cross_entropy.py)
  on the reference step's logits (4096 x 128256): the same cast tiles, without the logits' gradient
  (drop_logits), with an all-zero one and with a random one (with a dy: the kernel writes q and q^T is
  a transposed copy of it, codegen/transpose.py, whose tiles are swept there); each row checks q against
  torch, and q^T against q; then the transposed copy alone, and torch's copy_ of q.t().

    python benchmarks/tune_fp8_quantize.py [--parts strided tensorwise grad_cast]
"""
import argparse
import itertools
import json
import os

import torch

from common import bench_gpu_ms, env, save, table
from fusion_compiler.codegen import fp8, fp8_cross_entropy, transpose

SHAPES = ((4096, 2048), (4096, 8192), (8192, 2048), (4096, 512), (4096, 128256))
E4M3 = torch.float8_e4m3fn


def _best(timed: list, default: tuple) -> list:
    timed.sort(key=lambda r: r["ms"])
    print(json.dumps(timed[:3]), flush=True)
    mark = next(r for r in timed if r["tiles"] == str(default))
    return timed[:3] + [dict(mark, tiles=mark["tiles"] + " (default)")]


def strided_rows(m: int, k: int) -> list:
    t = torch.randn(m, k, device="cuda", dtype=torch.bfloat16).t()
    q = torch.empty(t.shape, device="cuda", dtype=E4M3)
    inv = torch.empty((t.shape[0], 1), device="cuda", dtype=torch.float32)
    ref_q, ref_inv = fp8.quantize_reference(t, E4M3)
    timed = []
    for tiles in itertools.product((32, 64, 128), (32, 64, 128), (256, 1024), (4, 8)):
        fp8.quantize_strided(t, q, inv, E4M3, tiles)
        assert torch.allclose(inv, ref_inv, rtol=1e-6), tiles
        ms = bench_gpu_ms(lambda: fp8.quantize_strided(t, q, inv, E4M3, tiles))
        timed.append(dict(part="strided", shape=f"{tuple(t.shape)}", tiles=str(tiles), ms=round(ms, 4),
                          gbps=round(3 * m * k / ms / 1e6)))
    return _best(timed, fp8.STRIDED_TILES)


def tensorwise_rows(m: int, k: int) -> list:
    t = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref_q, ref_qt, ref_inv = fp8.quantize_tensorwise_reference(t, E4M3)
    default, timed = fp8.TENSOR_TILES, []
    try:
        for tiles in itertools.product((32, 64, 128), (64, 128, 256), (4, 8)):
            fp8.TENSOR_TILES = tiles
            q, qt, inv = fp8.quantize_tensorwise(t, E4M3)
            assert torch.allclose(inv, ref_inv, rtol=1e-6) and torch.equal(qt.float(), q.float().t()), tiles
            ms = bench_gpu_ms(lambda: fp8.quantize_tensorwise(t, E4M3))
            timed.append(dict(part="tensorwise", shape=f"{tuple(t.shape)}", tiles=str(tiles), ms=round(ms, 4),
                              gbps=round(6 * m * k / ms / 1e6)))
    finally:
        fp8.TENSOR_TILES = default
    return _best(timed, default)


TILES = ((32, 128, 4), (32, 256, 4), (64, 128, 4), (64, 128, 8), (64, 256, 8), (128, 64, 8),
        (128, 128, 8), (128, 256, 8))


TRANSPOSE_TILES = ((64, 128, 4), (32, 128, 4), (64, 64, 4), (128, 128, 8), (128, 64, 4), (64, 256, 8))


def grad_cast_rows(n: int = 4096, v: int = 128256) -> list:
    """Without a dy: every cast tile. With one: the default cast tile and every tile of the transposed
    copy that writes q^T (codegen/transpose.py)."""
    logits = torch.randn(n, v, device="cuda", dtype=torch.bfloat16) * 3
    target = torch.randint(0, v, (n,), device="cuda")
    _, lse, amax = fp8_cross_entropy.stats(logits, target, -100)
    dloss, count = torch.ones((), device="cuda"), torch.tensor(float(n), device="cuda")
    zeros = torch.zeros_like(logits)
    defaults, rows = (fp8_cross_entropy.GRAD_CAST_TILES, transpose.TILES), []
    try:
        for dy, label in ((None, "grad_cast"), (zeros, "grad_cast, zero dy"), (zeros + 1e-4 * torch.randn_like(zeros),
                                                                              "grad_cast, dy")):
            ref_q, _, ref_inv = fp8_cross_entropy.grad_cast_reference(logits, lse, target, dy, dloss, count, amax, -100,
                                                                      True, torch.float8_e5m2, transposed=False)
            timed = []
            for tiles in (TILES if dy is None else TRANSPOSE_TILES):
                if dy is None:
                    fp8_cross_entropy.GRAD_CAST_TILES = tiles
                else:
                    transpose.TILES = tiles
                run = lambda: fp8_cross_entropy.grad_cast(logits, lse, target, dy, dloss, count, amax, -100, True,
                                                          torch.float8_e5m2)
                q, qt, inv = run()
                checks = dict(inv_rel=f"{((inv - ref_inv).abs() / ref_inv).item():.1e}",
                              qt_unlike_q_t=f"{(qt.float() != q.float().t()).float().mean().item():.1e}",
                              q_unlike_torch=f"{(q.float() != ref_q.float()).float().mean().item():.1e}",
                              # below: within an e5m2 step
                              q_in_a_step=torch.allclose(q.float(), ref_q.float(), rtol=0.25, atol=2.0 ** -16))
                ms = bench_gpu_ms(run)
                timed.append(dict(part=label if dy is None else f"{label}, transpose", shape=f"({n}, {v})",
                                  tiles=str(tiles), ms=round(ms, 4), gbps=round(4 * n * v / ms / 1e6), **checks))
            rows += sorted(timed, key=lambda r: r["ms"])
        q = ref_q.contiguous()
        qt = torch.empty(v, n, dtype=q.dtype, device="cuda")
        for tiles in TRANSPOSE_TILES:  # the copy alone: 2 bytes an element moved
            transpose.TILES = tiles
            ms = bench_gpu_ms(lambda: transpose.transpose_bytes(q, qt))
            rows.append(dict(part="transpose alone", shape=f"({n}, {v})", tiles=str(tiles), ms=round(ms, 4),
                             gbps=round(2 * n * v / ms / 1e6),
                             qt_unlike_q_t=f"{(qt.float() != q.float().t()).float().mean().item():.1e}"))
        ms = bench_gpu_ms(lambda: qt.copy_(q.t()))
        rows.append(dict(part="torch copy_(q.t())", shape=f"({n}, {v})", ms=round(ms, 4), gbps=round(2 * n * v / ms / 1e6)))
    finally:
        fp8_cross_entropy.GRAD_CAST_TILES, transpose.TILES = defaults
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", nargs="+", default=["strided", "tensorwise"])
    a = ap.parse_args()
    rows = []
    for m, k in SHAPES:
        if "strided" in a.parts and k < 100000:
            rows += strided_rows(m, k)
        if "tensorwise" in a.parts:
            rows += tensorwise_rows(m, k)
    if "grad_cast" in a.parts:
        rows += grad_cast_rows()
    save(os.environ.get("BENCH_NAME", "tune_fp8_quantize.json"), {"env": env(), "rows": rows})
    print(table(rows, ["part", "shape", "tiles", "ms", "gbps", "inv_rel", "qt_unlike_q_t", "q_unlike_torch", "q_in_a_step"]))


if __name__ == "__main__":
    main()
