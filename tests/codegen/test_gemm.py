"""The generated GEMM + epilogue kernels (Triton interpreter) against float64 eager: forward, the
product saved for the backward, every gradient (operands and side inputs), reductions over N,
batched products, sizes that are not multiples of the 32x32x32 interpreter tile."""
import pytest
import torch
import torch.nn.functional as F

from fusion_compiler.codegen import gemm, tuning
from tests.helpers import TOL, assert_close, rel_err

Z, V0, V1 = ("z",), ("v", 0), ("v", 1)


def s(j):
    return ("s", j)


def c(x):
    return ("c", x)


def _run(ep, a, b, sides, shape, out_dtype, upstream=None):
    """Our forward and backward (through the custom op's autograd) and eager's, in float64."""
    leaves = [t.detach().clone().requires_grad_() for t in (a, b, *sides)]
    y, _ = torch.ops.fusion.gemm_epilogue(ep.text(), leaves[0], leaves[1], leaves[2:], list(shape), out_dtype, True)
    ref_leaves = [t.detach().double().requires_grad_() for t in (a, b, *sides)]
    ref = _eager(ep, ref_leaves[0] @ ref_leaves[1], ref_leaves[2:], shape)
    g = torch.randn(ref.shape, dtype=torch.float64) if upstream is None else upstream
    got = torch.autograd.grad(y, leaves, g.to(y.dtype))
    want = torch.autograd.grad(ref, ref_leaves, g)
    return y, ref, got, want


_EAGER = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "neg": torch.neg, "abs": torch.abs,
    "exp": torch.exp, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "relu": torch.relu, "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "mish": F.mish, "softplus": F.softplus,
    "hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid, "leaky_relu": F.leaky_relu,
    "clamp": torch.clamp, "clamp_min": torch.clamp_min, "clamp_max": torch.clamp_max, "square": torch.square,
    "cast": lambda x: x,
}


def _eager(ep, product, sides, shape):
    env = {Z: product.reshape(shape)}

    def get(ref):
        return ref[1] if ref[0] == "c" else sides[ref[1]] if ref[0] == "s" else env[ref]
    for k, (op, refs) in enumerate(ep.steps):
        env[("v", k)] = _EAGER[op](*[get(r) for r in refs])
    y = env[("v", len(ep.steps) - 1)] if ep.steps else env[Z]
    if ep.reduce == "sum":
        return y.sum(-1, keepdim=ep.keepdim)
    if ep.reduce:
        return getattr(torch, ep.reduce)(y, -1, keepdim=ep.keepdim)
    return y


# (name, steps, sides as shapes relative to the [B, S, N] chain)
CHAINS = [
    ("bias_relu", (("add", (Z, s(0))), ("relu", (V0,))), ["n"]),
    ("bias_relu_scale", (("add", (Z, s(0))), ("relu", (V0,)), ("mul", (V1, c(0.5)))), ["n"]),
    ("gelu", (("gelu", (Z,)),), []),
    ("bias_gelu_tanh", (("add", (Z, s(0))), ("gelu_tanh", (V0,))), ["n"]),
    ("silu_residual", (("silu", (Z,)), ("add", (V0, s(0)))), ["full"]),
    ("mish", (("mish", (Z,)),), []),
    ("hardswish", (("hardswish", (Z,)),), []),
    ("hardsigmoid_row_scale", (("hardsigmoid", (Z,)), ("mul", (V0, s(0)))), ["row"]),
    ("leaky_relu", (("leaky_relu", (Z, c(0.2))),), []),
    ("sigmoid_tensor_scale", (("sigmoid", (Z,)), ("mul", (V0, s(0)))), ["scalar"]),
    ("tanh_sub", (("tanh", (Z,)), ("sub", (s(0), V0))), ["n"]),
    ("clamp", (("clamp", (Z, c(-0.5), c(0.5))),), []),
    ("clamp_min_max", (("clamp_min", (Z, c(-0.3))), ("clamp_max", (V0, c(0.7)))), []),
    ("softplus_div", (("softplus", (Z,)), ("div", (V0, s(0)))), ["n_positive"]),
    ("square_neg_exp", (("div", (Z, c(4.0))), ("square", (V0,)), ("neg", (("v", 1),)), ("exp", (("v", 2),))), []),
    ("abs_self_product", (("abs", (Z,)), ("mul", (V0, V0))), []),
]


def _side(kind, b_, s_, n):
    return {"n": torch.randn(n), "n_positive": torch.rand(n) + 0.5, "full": torch.randn(b_, s_, n),
            "row": torch.randn(b_, s_, 1), "scalar": torch.randn(())}[kind]


@pytest.mark.parametrize("name,steps,kinds", CHAINS, ids=[c_[0] for c_ in CHAINS])
def test_chain_fp32(name, steps, kinds):
    b_, s_, k, n = 2, 19, 37, 45  # 38 rows x 45 cols x 37 deep: no dim a multiple of the 32-tile
    x, w = torch.randn(b_ * s_, k), torch.randn(n, k) / k ** 0.5
    sides = [_side(kind, b_, s_, n) for kind in kinds]
    ep = gemm.Epilogue(len(sides), steps)
    y, ref, got, want = _run(ep, x, w.t(), sides, (b_, s_, n), torch.float32)
    assert_close(y, ref, torch.float32, f"{name} forward")
    for i, (a_, b2) in enumerate(zip(got, want)):
        assert_close(a_, b2, torch.float32, f"{name} grad {i}", factor=3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,steps,kinds", CHAINS[:6], ids=[c_[0] for c_ in CHAINS[:6]])
def test_chain_low_precision(name, steps, kinds, dtype):
    """Forward against float64. Gradients against float64 or, where they differ from it by more
    than the dtype's tolerance, against eager in the same dtype: eager rounds the product to the
    dtype before relu/clamp decide which elements pass a gradient, so a product within an ulp of
    the threshold flips a whole element's gradient in eager too (~3% of the norm per flip here);
    the backward reads the product rounded as eager's (nearest-even), so it flips the same ones."""
    b_, s_, k, n = 3, 11, 40, 33
    x, w = torch.randn(b_ * s_, k, dtype=dtype), (torch.randn(n, k) / k ** 0.5).to(dtype)
    sides = [_side(kind, b_, s_, n).to(dtype) for kind in kinds]
    ep = gemm.Epilogue(len(sides), steps)
    y, ref, got, want = _run(ep, x, w.t(), sides, (b_, s_, n), dtype)
    assert y.dtype == dtype
    assert_close(y, ref, dtype, f"{name} forward")
    same = [t.detach().clone().requires_grad_() for t in (x, w.t(), *sides)]
    upstream = torch.randn(ref.shape, dtype=torch.float64)
    same_grads = torch.autograd.grad(_eager(ep, same[0] @ same[1], same[2:], (b_, s_, n)), same, upstream.to(dtype))
    _, _, got, want = _run(ep, x, w.t(), sides, (b_, s_, n), dtype, upstream)
    for i, (a_, b64, b_same) in enumerate(zip(got, want, same_grads)):
        err = min(rel_err(a_, b64), rel_err(a_, b_same))
        assert err <= TOL[dtype], f"{name} grad {i}: {rel_err(a_, b64):.2e} vs float64, {rel_err(a_, b_same):.2e} vs eager"


@pytest.mark.parametrize("reduce", ["sum", "mean", "logsumexp", "amax"])
@pytest.mark.parametrize("keepdim", [False, True])
def test_reduction_over_n(reduce, keepdim):
    x, w, bias = torch.randn(2, 21, 64), torch.randn(70, 64) / 8.0, torch.randn(70)  # K = 2 tiles: no K tail
    ep = gemm.Epilogue(1, (("add", (Z, s(0))), ("gelu", (V0,))), reduce, keepdim)
    if reduce == "amax":  # forward only (no generated backward: ties)
        y, z = gemm.forward(ep, x, w.t(), [bias], (2, 21, 70), torch.float32, False)
        ref = _eager(ep, (x @ w.t()).double(), [bias.double()], (2, 21, 70))
        assert z.numel() == 0 and y.shape == ref.shape
        assert_close(y, ref, torch.float32, "amax")
        return
    y, ref, got, want = _run(ep, x, w.t(), [bias], (2, 21, 70), torch.float32)
    assert y.shape == ref.shape
    assert_close(y, ref, torch.float32, f"{reduce} forward")
    for i, (a_, b2) in enumerate(zip(got, want)):
        assert_close(a_, b2, torch.float32, f"{reduce} grad {i}", factor=3)


def test_logsumexp_of_minus_infinity_rows():
    """A row that is all -inf gives -inf, not NaN (the tile max is guarded)."""
    x, w = torch.randn(5, 8), torch.randn(8, 40)
    ep = gemm.Epilogue(1, (("add", (Z, s(0))),), "logsumexp")
    mask = torch.zeros(5, 40)
    mask[2] = float("-inf")
    y, _ = gemm.forward(ep, x, w, [mask], (5, 40), torch.float32, False)
    ref = torch.logsumexp(x @ w + mask, -1)
    assert torch.isinf(y[2]) and y[2] < 0
    assert torch.allclose(y[[0, 1, 3, 4]], ref[[0, 1, 3, 4]], atol=1e-5)


@pytest.mark.parametrize("reduce", ["sum", "mean", "logsumexp", "amax"])
def test_reduction_over_more_tiles_than_the_second_stage_reads_at_once(reduce):
    """N = 2270 is 71 column tiles of 32: the second stage walks the partials in chunks of 64, and
    the rows' scales differ by 30x (logsumexp's max is taken over every chunk before it sums)."""
    x, w = torch.randn(37, 16) * torch.linspace(0.2, 6.0, 37)[:, None], torch.randn(2270, 16) / 4.0
    ep = gemm.Epilogue(0, (), reduce)
    y, _ = gemm.forward(ep, x, w.t(), [], (37, 2270), torch.float32, False)
    ref = _eager(ep, (x @ w.t()).double(), [], (37, 2270))
    assert_close(y, ref, torch.float32, reduce)


def test_batched_product_with_batch_broadcast_side():
    """bmm [B, M, K] @ [B, K, N] with a side shared by the batch ([M, N]) and a per-batch row scale."""
    a, b = torch.randn(3, 17, 20), torch.randn(3, 20, 35)
    sides = [torch.randn(17, 35), torch.randn(3, 17, 1)]
    ep = gemm.Epilogue(2, (("add", (Z, s(0))), ("tanh", (V0,)), ("mul", (V1, s(1)))))
    y, ref, got, want = _run(ep, a, b, sides, (3, 17, 35), torch.float32)
    assert_close(y, ref, torch.float32, "forward")
    for i, (a_, b2) in enumerate(zip(got, want)):
        assert_close(a_, b2, torch.float32, f"grad {i}", factor=3)


def test_three_d_input_is_folded_or_batched():
    """x [B, S, K] @ w^T: folded into one [B*S, K] product when the sides allow, batched when a
    side ([B, 1, N]) cannot be read in the folded rows; both right."""
    x, w = torch.randn(2, 9, 16), torch.randn(24, 16)
    fold = gemm.layout(x, w.t(), [torch.randn(24)], (2, 9, 24))
    batched = gemm.layout(x, w.t(), [torch.randn(2, 1, 24)], (2, 9, 24))
    assert (fold.batch, fold.m) == (1, 18) and (batched.batch, batched.m) == (2, 9)
    ep = gemm.Epilogue(1, (("mul", (Z, s(0))),))
    side = torch.randn(2, 1, 24)
    y, ref, got, want = _run(ep, x, w.t(), [side], (2, 9, 24), torch.float32)
    assert_close(y, ref, torch.float32, "forward")
    for i, (a_, b2) in enumerate(zip(got, want)):
        assert_close(a_, b2, torch.float32, f"grad {i}", factor=3)


def test_backward_reads_the_product_only_when_needed():
    linear = gemm.Epilogue(2, (("add", (Z, s(0))), ("mul", (V0, s(1)))))
    assert not linear.backward_reads_product([True, False])  # d/dz = s1: the product is never written
    assert linear.backward_reads_product([True, True])  # d/ds1 = z + s0
    assert gemm.Epilogue(0, (("relu", (Z,)),)).backward_reads_product()
    assert gemm.Epilogue(0, (), "logsumexp").backward_reads_product()
    assert not gemm.Epilogue(0, (), "sum").backward_reads_product()


def test_epilogue_text_round_trip():
    ep = gemm.Epilogue(1, (("add", (Z, s(0))), ("leaky_relu", (V0, c(0.1)))), "logsumexp", True)
    assert gemm.Epilogue.parse(ep.text()) == ep
    with pytest.raises(ValueError, match="no generated form"):
        gemm.Epilogue(0, (("sin", (Z,)),))
    with pytest.raises(ValueError, match="reduce"):
        gemm.Epilogue(0, (), "median")


def test_output_is_poisoned_then_fully_written():
    """conftest poisons outputs with NaN: every element of y is written (assert_close rejects NaN)."""
    x, w = torch.randn(65, 33), torch.randn(33, 66)
    ep = gemm.Epilogue(0, (("relu", (Z,)),))
    y, z = gemm.forward(ep, x, w, [], (65, 66), torch.float32, True)
    assert not torch.isnan(y).any() and not torch.isnan(z).any()
    assert_close(z, (x.double() @ w.double()), torch.float32, "saved product")


def test_tuned_config_is_read_from_the_json_cache(tmp_path, monkeypatch):
    """A config stored for a shape is the one forward launches (a 16-wide tile here)."""
    monkeypatch.setenv("FUSION_TUNING_CACHE", str(tmp_path / "tuning.json"))
    tuning.clear()
    x, w = torch.randn(20, 24), torch.randn(24, 18)
    ep = gemm.Epilogue(0, (("silu", (Z,)),))
    key = gemm.tuning_key(ep, gemm.layout(x, w, [], (20, 18)), False)
    tuning.record(key, {"config": [16, 16, 16, 2, 1, 2], "ms": 1.0, "baseline_ms": 2.0})
    tuning.clear()  # read back from disk
    assert tuning.lookup(key) == (16, 16, 16, 2, 1, 2)
    launched = []
    real = gemm._kernel

    def spy(key_, make, name):
        k = real(key_, make, name)

        class Grid:
            def __getitem__(self, grid):
                launched.append(grid)
                return k[grid]
        return Grid()
    monkeypatch.setattr(gemm, "_kernel", spy)
    y, _ = gemm.forward(ep, x, w, [], (20, 18), torch.float32, False)
    assert launched == [(4, 1)]  # ceil(20/16) * ceil(18/16) tiles of 16x16
    assert_close(y, F.silu(x.double() @ w.double()), torch.float32, "tuned config")
    tuning.clear()


def test_tuning_retimes_each_epilogue_at_the_sweeps_fastest_configs(tmp_path, monkeypatch):
    """The tile sweep runs once per shape (with the first epilogue); a second epilogue on that shape
    is timed at the sweep's RETIME fastest configs and keeps its own best, which need not be the
    sweep's. Times come from a table (the timer is CUDA's; the kernels still run, on the interpreter)."""
    monkeypatch.setenv("FUSION_TUNING_CACHE", str(tmp_path / "tuning.json"))
    tuning.clear()
    tiles = [(16, 16, 16, 2, 1, 2), (32, 16, 16, 2, 1, 2), (16, 32, 16, 2, 1, 2), (32, 32, 16, 2, 1, 2)]
    monkeypatch.setattr(gemm, "configs", lambda element_size: tiles)
    relu, gelu = gemm.Epilogue(0, (("relu", (Z,)),)), gemm.Epilogue(0, (("gelu", (Z,)),))
    # relu: the tiles in order; gelu: fails to compile at the second tile, the third best, the fourth
    # (outside the sweep's three fastest) better still but never timed
    table = {relu: [1.0, 2.0, 3.0, 4.0], gelu: [5.0, None, 3.5, 0.5]}
    calls = []
    real_forward = gemm.forward

    def forward(ep, *args):
        calls.append((ep, args[-1]))
        return real_forward(ep, *args)

    def bench(fn):
        fn()
        ep, config = calls[-1]
        if config is None:  # cuBLAS's product
            return 1.0
        ms = table[ep][tiles.index(tuple(config[:6]))]
        if ms is None:
            raise RuntimeError("out of resources")
        return ms
    monkeypatch.setattr(gemm, "forward", forward)
    monkeypatch.setattr(gemm, "_bench", bench)
    monkeypatch.setattr(torch, "matmul", lambda a, b: calls.append((None, None)))
    x, w = torch.randn(20, 24), torch.randn(24, 18)
    first = gemm.tune(relu, x, w, [], (20, 18), torch.float32, False)
    assert tuple(first["config"][:6]) == tiles[0]
    timed_before = len(calls)
    second = gemm.tune(gelu, x, w, [], (20, 18), torch.float32, False)
    timed = [tuple(c[:6]) for ep, c in calls[timed_before:]]
    assert len(timed) == gemm.RETIME and tiles[3] not in timed  # no second sweep
    assert tuple(second["config"][:6]) == tiles[2] and second["ms"] == 3.5
    assert gemm.tune(gelu, x, w, [], (20, 18), torch.float32, False) == second  # stored
    tuning.clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("loads", ["pointer", "tma", "tma_bt", "tma_persistent", "tma_bt_persistent",
                                   "tma_bt_halves", "tma_persistent_halves"])
def test_main_loop_by_pointers_or_tma(loads, dtype):
    """The K loop reads A and B by pointers or by TMA descriptors (B as stored or transposed, as
    F.linear's weight); rows of 16-byte multiples, sizes off the 32-tile (zero-filled edges). The
    persistent modes run one program here (one SM under the interpreter) over all four tiles; the
    halves modes run the epilogue on each tile's two column halves (the right one past N at the edge)."""
    x = torch.randn(45, 40, dtype=dtype)
    w = (torch.randn(56, 40) / 40 ** 0.5).to(dtype)  # rows of 16-byte multiples, off the 32-tile
    mode = loads.removesuffix(gemm.HALVES).removesuffix(gemm.PERSISTENT)
    b = w.t() if mode != "tma" else w.t().contiguous()  # [K, N]: a strided view of [N, K], or stored
    lay = gemm.layout(x, b, [], (45, 56))
    assert gemm.tma_loads(lay) == ("tma_bt" if mode == "tma_bt" else "tma") or loads == "pointer"
    assert loads in gemm.load_modes(lay)
    ep = gemm.Epilogue(0, (("gelu", (Z,)),))
    y, z = gemm.forward(ep, x, b, [], (45, 56), dtype, True, config=(32, 32, 32, 4, 1, 4, loads))
    ref = x.double() @ b.double()
    assert_close(z, ref, dtype, "product")
    assert_close(y, F.gelu(ref), dtype, "gelu")


@pytest.mark.parametrize("reduce,loads", [("", "tma_bt_persistent"), ("logsumexp", "tma_bt_persistent"),
                                          ("", "tma_bt_persistent_halves")])
def test_persistent_tiles_read_their_own_sides_and_partials(reduce, loads):
    """One program walks every tile in turn: the bias row, the residual tile and the reduction's
    per-tile partials must follow the tile (and under HALVES the column half), not the program; the
    product saved for the backward too."""
    x, w = torch.randn(70, 48), torch.randn(72, 48) / 48 ** 0.5
    bias, res = torch.randn(72), torch.randn(70, 72)
    ep = gemm.Epilogue(2, (("add", (Z, s(0))), ("tanh", (V0,)), ("add", (V1, s(1)))), reduce)
    y, z = gemm.forward(ep, x, w.t(), [bias, res], (70, 72), torch.float32, True,
                        config=(32, 32, 16, 2, 1, 4, loads))
    product = x.double() @ w.t().double()
    ref = torch.tanh(product + bias.double()) + res.double()
    if reduce:
        ref = torch.logsumexp(ref, -1)
    assert_close(y, ref, torch.float32, reduce or "tiles")
    assert_close(z, product, torch.float32, "saved product")


def test_reductions_take_the_whole_tile():
    """A reduction over N combines per-tile partials: it neither runs on column halves (a tuned
    HALVES config from elsewhere is read as the whole tile) nor shares the writing epilogues' sweep."""
    x, w = torch.randn(40, 32), torch.randn(48, 32)
    amax = gemm.Epilogue(0, (("relu", (Z,)),), "amax")
    with pytest.raises(ValueError, match="whole tile"):
        gemm.forward_source(amax, torch.float32, torch.float32, (), "tma_bt_persistent_halves")
    y, _ = gemm.forward(amax, x, w.t(), [], (40, 48), torch.float32, False,
                        config=(32, 32, 16, 2, 1, 4, "tma_bt_persistent_halves"))
    assert_close(y, torch.relu(x.double() @ w.t().double()).amax(-1), torch.float32, "amax")
    lay = gemm.layout(x, w.t(), [], (40, 48))
    assert not any(m.endswith(gemm.HALVES) for m in gemm.load_modes(lay, "amax"))
    assert "tma_bt_persistent_halves" in gemm.load_modes(lay)
    relu = gemm.Epilogue(0, (("relu", (Z,)),))
    keys = {gemm.tuning_key(e, lay, False, sweep=True) for e in (amax, relu, gemm.Epilogue(0, (("gelu", (Z,)),)))}
    assert len(keys) == 2


def test_unaligned_rows_fall_back_to_pointers():
    x = torch.randn(20, 37)  # 148-byte rows: no TMA
    assert gemm.tma_loads(gemm.layout(x, torch.randn(37, 24), [], (20, 24))) is None
