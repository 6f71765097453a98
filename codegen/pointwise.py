"""Elementwise ops as Triton expressions, and their derivatives: the vocabulary of generated kernels.

Each entry maps an op name to a function of its (already formatted) argument expressions, all fp32.
ARITHMETIC is what multi-tensor updates use (IEEE-rounded division and square root, so fp32 results
agree with eager to the last bit or two); ACTIVATIONS adds the functions GEMM epilogues apply.

DERIVATIVES maps an op to the partial derivatives of its result with respect to each argument,
as expressions of the arguments and of the result `out` (None where an argument is a constant of
the op, such as a clamp bound). They follow ATen's backward formulas (derivatives.yaml), e.g.
relu's gradient is 0 where the input is not positive, clamp passes the gradient where
min <= x <= max, tanh-GELU differentiates the tanh approximation itself.
"""
# fp32 -> nearest bf16 (ties to even), kept in fp32: the bits, not a cast (Triton's interpreter
# truncates in its bf16 cast, which would move a weight-decayed parameter down by an ulp each step)
ROUND_BF16 = """@triton.jit
def _round_bf16(x):
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))"""

_SQRT1_2 = 0.7071067811865476  # 1 / sqrt(2)
_INV_SQRT_2PI = 0.3989422804014327  # 1 / sqrt(2 pi)
_K_BETA = 0.7978845608028654  # sqrt(2 / pi)
_K_KAPPA = 0.044715


def _tanh(a: str) -> str:
    return f"(2.0 * tl.sigmoid(2.0 * ({a})) - 1.0)"


def _softplus(a: str) -> str:  # ATen's threshold: x itself above 20
    return f"tl.where({a} > 20.0, {a}, tl.log(1.0 + tl.exp(tl.minimum({a}, 20.0))))"


ARITHMETIC = {
    "add": lambda a, b: f"{a} + {b}",
    "sub": lambda a, b: f"{a} - {b}",
    "mul": lambda a, b: f"{a} * {b}",
    "div": lambda a, b: f"tl.math.div_rn({a}, {b})",
    "neg": lambda a: f"-{a}",
    "abs": lambda a: f"tl.abs({a})",
    "sqrt": lambda a: f"tl.math.sqrt_rn({a})",
    "rsqrt": lambda a: f"tl.math.div_rn(1.0, tl.math.sqrt_rn({a}))",
    "reciprocal": lambda a: f"tl.math.div_rn(1.0, {a})",
    "exp": lambda a: f"tl.exp({a})",
    "log": lambda a: f"tl.log({a})",
    "sigmoid": lambda a: f"tl.sigmoid({a})",
    "tanh": _tanh,
    "sign": lambda a: f"(({a} > 0).to(tl.float32) - ({a} < 0).to(tl.float32))",
    "maximum": lambda a, b: f"tl.maximum({a}, {b}, propagate_nan=tl.PropagateNan.ALL)",
    "minimum": lambda a, b: f"tl.minimum({a}, {b}, propagate_nan=tl.PropagateNan.ALL)",
    "fma": lambda a, b, c: f"{a} * {b} + {c}",
    # torch.lerp: a + w (b - a) for |w| < 0.5, else b - (b - a)(1 - w)
    "lerp": lambda a, b, w: (f"tl.where(tl.abs({w}) < 0.5, {a} + {w} * ({b} - {a}), "
                             f"{b} - ({b} - {a}) * (1.0 - {w}))"),
    "where": lambda c, a, b: f"tl.where({c}, {a}, {b})",
    "gt": lambda a, b: f"{a} > {b}",
    "lt": lambda a, b: f"{a} < {b}",
    "ge": lambda a, b: f"{a} >= {b}",
    "le": lambda a, b: f"{a} <= {b}",
    "eq": lambda a, b: f"{a} == {b}",
    "ne": lambda a, b: f"{a} != {b}",
    "cast": lambda a: f"{a}",
}

ACTIVATIONS = {
    "relu": lambda a: f"tl.where({a} < 0.0, 0.0, {a})",  # NaN stays NaN, as in torch.relu
    "gelu": lambda a: f"0.5 * {a} * (1.0 + tl.math.erf({a} * {_SQRT1_2}))",
    "gelu_tanh": lambda a: f"0.5 * {a} * (1.0 + {_tanh(f'{_K_BETA} * ({a} + {_K_KAPPA} * {a} * {a} * {a})')})",
    "silu": lambda a: f"{a} * tl.sigmoid({a})",
    "mish": lambda a: f"{a} * {_tanh(_softplus(a))}",
    "softplus": _softplus,
    "hardswish": lambda a: f"{a} * tl.minimum(tl.maximum({a} + 3.0, 0.0), 6.0) / 6.0",
    "hardsigmoid": lambda a: f"tl.minimum(tl.maximum({a} + 3.0, 0.0), 6.0) / 6.0",
    "leaky_relu": lambda a, slope: f"tl.where({a} > 0.0, {a}, {a} * {slope})",
    "clamp": lambda a, lo, hi: f"tl.where({a} != {a}, {a}, tl.minimum(tl.maximum({a}, {lo}), {hi}))",
    "clamp_min": lambda a, lo: f"tl.where({a} != {a}, {a}, tl.maximum({a}, {lo}))",
    "clamp_max": lambda a, hi: f"tl.where({a} != {a}, {a}, tl.minimum({a}, {hi}))",
    "square": lambda a: f"{a} * {a}",
}

TRITON = {**ARITHMETIC, **ACTIVATIONS}


def _gelu_tanh_grad(a: str) -> str:
    inner = f"{_K_BETA} * ({a} + {_K_KAPPA} * {a} * {a} * {a})"
    t = _tanh(inner)
    return (f"(0.5 * (1.0 + {t}) + 0.5 * {a} * (1.0 - {t} * {t}) * "
            f"{_K_BETA} * (1.0 + {3 * _K_KAPPA} * {a} * {a}))")


# op -> function(args..., out) -> tuple of partials per argument (None: not differentiated)
DERIVATIVES = {
    "add": lambda a, b, out: ("1.0", "1.0"),
    "sub": lambda a, b, out: ("1.0", "-1.0"),
    "mul": lambda a, b, out: (b, a),
    "div": lambda a, b, out: (f"(1.0 / {b})", f"(-{a} / ({b} * {b}))"),
    "neg": lambda a, out: ("-1.0",),
    "abs": lambda a, out: (ARITHMETIC["sign"](a),),
    "exp": lambda a, out: (out,),
    "sigmoid": lambda a, out: (f"{out} * (1.0 - {out})",),
    "tanh": lambda a, out: (f"(1.0 - {out} * {out})",),
    "cast": lambda a, out: ("1.0",),
    "relu": lambda a, out: (f"tl.where({out} > 0.0, 1.0, 0.0)",),
    "gelu": lambda a, out: (f"(0.5 * (1.0 + tl.math.erf({a} * {_SQRT1_2})) + {a} * {_INV_SQRT_2PI} * "
                            f"tl.exp(-0.5 * {a} * {a}))",),
    "gelu_tanh": lambda a, out: (_gelu_tanh_grad(a),),
    "silu": lambda a, out: (f"tl.sigmoid({a}) * (1.0 + {a} * (1.0 - tl.sigmoid({a})))",),
    "mish": lambda a, out: (f"({_tanh(_softplus(a))} + {a} * tl.sigmoid({a}) * "
                            f"(1.0 - {_tanh(_softplus(a))} * {_tanh(_softplus(a))}))",),
    "softplus": lambda a, out: (f"tl.where({a} > 20.0, 1.0, tl.sigmoid({a}))",),
    "hardswish": lambda a, out: (f"tl.where({a} < -3.0, 0.0, tl.where({a} <= 3.0, {a} / 3.0 + 0.5, 1.0))",),
    "hardsigmoid": lambda a, out: (f"tl.where(({a} > -3.0) & ({a} < 3.0), 1.0 / 6.0, 0.0)",),
    "leaky_relu": lambda a, slope, out: (f"tl.where({a} > 0.0, 1.0, {slope})", None),
    "clamp": lambda a, lo, hi, out: (f"tl.where(({a} >= {lo}) & ({a} <= {hi}), 1.0, 0.0)", None, None),
    "clamp_min": lambda a, lo, out: (f"tl.where({a} >= {lo}, 1.0, 0.0)", None),
    "clamp_max": lambda a, hi, out: (f"tl.where({a} <= {hi}, 1.0, 0.0)", None),
    "square": lambda a, out: (f"2.0 * {a}",),
}
