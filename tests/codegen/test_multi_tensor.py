"""The multi-tensor kernel generator against eager ops: every program op, lanes of mixed sizes (empty,
one element, several blocks), in-place writes, per-lane scalars, bf16 rounding per step; the
sum-of-squares first pass; the foreach unroll against torch._foreach_* itself."""
import pytest
import torch

from fusion_compiler import state_update
from fusion_compiler.codegen import multi_tensor
from fusion_compiler.codegen.multi_tensor import Program

SIZES = [5000, 1, 0, 37, 4097]  # several 4096-element blocks (the interpreter's block), 1, empty, odd

UNARY = {"neg": torch.neg, "abs": torch.abs, "sqrt": lambda x: torch.sqrt(x.abs()),
         "rsqrt": lambda x: torch.rsqrt(x.abs() + 0.1), "reciprocal": lambda x: 1 / (x + 3),
         "exp": torch.exp, "log": lambda x: torch.log(x.abs() + 0.1), "sigmoid": torch.sigmoid,
         "tanh": torch.tanh, "sign": torch.sign}
# inputs of the unary ops that need a positive or shifted argument, as program steps
PRE = {"sqrt": [("abs", "x")], "rsqrt": [("abs", "x"), ("add", "c0.1")], "reciprocal": [("add", "c3.0")],
       "log": [("abs", "x"), ("add", "c0.1")]}


def _lanes(dtype=torch.float32):
    return [torch.randn(n, dtype=dtype) for n in SIZES]


def _step_args(prev, spec):
    return [prev] if spec == "x" else [prev, ("c", float(spec[1:]))]


@pytest.mark.parametrize("op", sorted(UNARY))
def test_unary_ops_write_in_place(op):
    steps, prev = [], ("w", 0)
    for name, spec in PRE.get(op, []):
        steps.append((name, tuple(_step_args(prev, spec)), "float32"))
        prev = ("v", len(steps) - 1)
    steps.append((op, (prev,), "float32"))
    program = Program((), ("float32",), 0, tuple(steps), ((0, ("v", len(steps) - 1)),))
    xs = _lanes()
    want = [UNARY[op](x.double()) for x in xs]  # float64 reference
    multi_tensor.apply(program, [], xs, torch.zeros(1, len(xs)))
    for x, w in zip(xs, want):
        torch.testing.assert_close(x.double(), w, atol=1e-6, rtol=1e-5)


BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": lambda a, b: a / (b.abs() + 0.5),
          "maximum": torch.maximum, "minimum": torch.minimum}


@pytest.mark.parametrize("op", sorted(BINARY) + ["lerp", "fma", "where_gt"])
def test_binary_and_ternary_ops_with_per_lane_scalars(op):
    """out = op(a, b) with a read-only, b written, and a per-lane scalar s (lerp weight, fma factor)."""
    a, b = _lanes(), _lanes()
    s = torch.rand(len(SIZES))
    b_ref = [t.clone() for t in b]
    if op in BINARY:
        second = ("v", 1) if op == "div" else ("w", 0)
        steps = [("abs", (("w", 0),), "float32"), ("add", (("v", 0), ("c", 0.5)), "float32"),
                 (op, (("r", 0), second), "float32")]
        want = [BINARY[op](x, y) for x, y in zip(a, b_ref)]
    elif op == "lerp":
        steps = [("lerp", (("r", 0), ("w", 0), ("s", 0)), "float32")]
        want = [torch.lerp(x, y, float(w)) for x, y, w in zip(a, b_ref, s)]
    elif op == "fma":
        steps = [("fma", (("r", 0), ("s", 0), ("w", 0)), "float32")]
        want = [x * float(w) + y for x, y, w in zip(a, b_ref, s)]
    else:
        steps = [("gt", (("r", 0), ("w", 0)), "bool"), ("where", (("v", 0), ("r", 0), ("s", 0)), "float32")]
        want = [torch.where(x > y, x, float(w)) for x, y, w in zip(a, b_ref, s)]
    program = Program(("float32",), ("float32",), 1, tuple(steps), ((0, ("v", len(steps) - 1)),))
    multi_tensor.apply(program, a, b, s[None, :].contiguous())
    for x, w in zip(b, want):
        torch.testing.assert_close(x, w, atol=1e-6, rtol=1e-5)


def test_bf16_steps_round_to_nearest_even_like_eager():
    """p <- p * 0.9999 + g * 1e-3 in bf16, each op rounded: eager's two bf16 roundings, not one."""
    p = [torch.randn(n, dtype=torch.bfloat16) for n in SIZES]
    g = [torch.randn(n, dtype=torch.bfloat16) for n in SIZES]
    want = [x * 0.9999 + y * 1e-3 for x, y in zip(p, g)]
    steps = (("mul", (("w", 0), ("c", 0.9999)), "bfloat16"), ("mul", (("r", 0), ("c", 1e-3)), "bfloat16"),
             ("add", (("v", 0), ("v", 1)), "bfloat16"))
    program = Program(("bfloat16",), ("bfloat16",), 0, steps, ((0, ("v", 2)),))
    multi_tensor.apply(program, g, p, torch.zeros(1, len(SIZES)))
    for x, w in zip(p, want):
        assert torch.equal(x, w), (x - w).abs().max()


def test_mixed_dtypes_in_one_lane():
    """An fp32 state written from a bf16 gradient, and the bf16 copy of it."""
    g = [torch.randn(n, dtype=torch.bfloat16) for n in SIZES]
    m = _lanes()
    p = [torch.empty(n, dtype=torch.bfloat16) for n in SIZES]
    m_ref = [x + y.float() * 0.5 for x, y in zip(m, g)]
    steps = (("cast", (("r", 0),), "float32"), ("mul", (("v", 0), ("c", 0.5)), "float32"),
             ("add", (("w", 0), ("v", 1)), "float32"), ("cast", (("v", 2),), "bfloat16"))
    program = Program(("bfloat16",), ("float32", "bfloat16"), 0, steps, ((0, ("v", 2)), (1, ("v", 3))))
    writes = [t for pair in zip(m, p) for t in pair]
    multi_tensor.apply(program, g, writes, torch.zeros(1, len(SIZES)))
    for x, y, w in zip(m, p, m_ref):
        torch.testing.assert_close(x, w)
        assert torch.equal(y, w.bfloat16())


def test_program_text_round_trips():
    program = Program(("float32",), ("bfloat16",), 1, (("lerp", (("r", 0), ("w", 0), ("s", 0)), "bfloat16"),),
                      ((0, ("v", 0)),))
    assert Program.parse(program.text()) == program


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_squares_per_lane(dtype):
    xs = [torch.randn(n, dtype=dtype) for n in SIZES]
    out = multi_tensor.sum_squares(xs)
    want = torch.stack([(x.double() ** 2).sum() for x in xs]).float()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


FOREACH = [
    ("_foreach_add_", lambda xs, ys: ([xs, ys], {"alpha": 0.3})),
    ("_foreach_mul", lambda xs, ys: ([xs, 1.5], {})),
    ("_foreach_lerp_", lambda xs, ys: ([xs, ys, 0.25], {})),
    ("_foreach_addcmul_", lambda xs, ys: ([xs, ys, ys], {"value": 0.1})),
    ("_foreach_addcdiv_", lambda xs, ys: ([xs, ys, [y.abs() + 1 for y in ys], torch.tensor([0.5, -2.0, 3.0])], {})),
    ("_foreach_maximum_", lambda xs, ys: ([xs, ys], {})),
    ("_foreach_sqrt", lambda xs, ys: ([[x.abs() for x in xs]], {})),
    ("_foreach_pow", lambda xs, ys: ([0.9, xs], {})),
    ("_foreach_norm", lambda xs, ys: ([xs, 2], {})),
    ("_foreach_sub_", lambda xs, ys: ([xs, [0.5, 1.0, 2.0]], {})),
]


@pytest.mark.parametrize("name,make", FOREACH, ids=[n for n, _ in FOREACH])
def test_unrolled_foreach_matches_torch_foreach(name, make):
    xs = [torch.randn(3, 4), torch.randn(7), torch.randn(1)]
    ys = [torch.randn_like(x) for x in xs]
    args, kwargs = make([x.clone() for x in xs], ys)
    want = getattr(torch, name)(*args, **kwargs)
    want_inputs = [t.clone() for t in args[0]] if isinstance(args[0], list) else None
    args2, kwargs2 = make([x.clone() for x in xs], ys)
    got = state_update.unrolled(name, args2, kwargs2)
    if name.endswith("_"):
        assert got is None
        for a, b in zip(args2[0], want_inputs):
            torch.testing.assert_close(a, b)
    else:
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("tiles", [None, (64, 2)], ids=["interpreter_blocks", "gpu_sized_blocks"])
def test_unaligned_views_and_the_torch_reference_agree(tiles, monkeypatch):
    """Lanes that start 4 bytes past a 16-byte boundary (views at storage offset 1) take the kernel
    without alignment hints; the same program through apply_eager (the torch fallback) agrees. Also
    with small blocks (many per lane, as on a GPU)."""
    if tiles:
        monkeypatch.setattr(multi_tensor, "block_size", lambda: tiles)
    steps = (("lerp", (("w", 0), ("r", 0), ("c", 0.1)), "float32"), ("mul", (("v", 0), ("s", 0)), "float32"),
             ("add", (("w", 1), ("v", 1)), "bfloat16"))
    program = Program(("float32",), ("float32", "bfloat16"), 1, steps, ((0, ("v", 0)), (1, ("v", 2))))
    reads = [torch.randn(n + 1)[1:] for n in SIZES]
    writes = [t for n in SIZES for t in (torch.randn(n + 1)[1:], torch.randn(n + 3, dtype=torch.bfloat16)[3:])]
    scalars = torch.rand(1, len(SIZES))
    twins = [t.clone() for t in writes]
    multi_tensor.apply(program, reads, writes, scalars)
    multi_tensor.apply_eager(program, reads, twins, scalars)
    for a, b in zip(writes, twins):  # bf16: an fp32 FMA difference may flip a rounding (1 ulp)
        tol = dict(atol=1e-6, rtol=1e-5) if a.dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
        torch.testing.assert_close(a, b, **tol)


def test_offsets_follow_dtypes_at_reused_addresses():
    """The allocator hands the same addresses to tensors of another dtype: offsets are recomputed."""
    program = Program((), ("float32",), 0, (("mul", (("w", 0), ("c", 2.0)), "float32"),), ((0, ("v", 0)),))
    program16 = Program((), ("bfloat16",), 0, (("mul", (("w", 0), ("c", 2.0)), "bfloat16"),), ((0, ("v", 0)),))
    storage = torch.zeros(64)
    as_bf16 = [storage[:8].view(torch.bfloat16), storage[8:16].view(torch.bfloat16)]
    as_fp32 = [storage[:8], storage[8:16]]  # the same two addresses
    for t in as_bf16:
        t.normal_()
    want16 = [t * 2 for t in as_bf16]
    multi_tensor.apply(program16, [], as_bf16, torch.zeros(1, 2))
    for t, w in zip(as_bf16, want16):
        assert torch.equal(t, w)
    storage.normal_()
    want = [t * 2 for t in as_fp32]
    multi_tensor.apply(program, [], as_fp32, torch.zeros(1, 2))
    for t, w in zip(as_fp32, want):
        torch.testing.assert_close(t, w)
