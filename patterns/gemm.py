"""GEMM family: a matrix product and the elementwise chain after it become one generated kernel.

    before:  y = F.gelu(F.linear(x, w, b)) * 0.5 + residual          (mm / addmm / bmm / matmul)
    after:   y, _ = fusion.gemm_epilogue(epilogue, x, w.t(), [b, residual], shape, dtype, save_product)

    before:  lse = torch.logsumexp(torch.relu(x @ w.t()), -1)
    after:   lse, _ = fusion.gemm_epilogue(...)     (per-tile partials over N, then a tiny second stage)

The chain is maximal: from the product (through a view that only splits its rows, as F.linear on
3-D input leaves) it takes each next node while the value so far has exactly one user and that user
is an elementwise op of OPS whose other operands are Python numbers or tensors broadcast to the
chain's shape (a bias, a per-row or per-tensor scale, a residual). It may end in a sum, mean, amax
or logsumexp over the last dim. Where something stops it (an intermediate with a second user, an op
the kernel does not generate, an operand it cannot read), the chain is cut there, not abandoned: the
region up to the cut is fused and the row says where and why it was cut.

    gemm_epilogue    the chain is elementwise
    gemm_reduction   the chain ends in a reduction over N (the GEMM output is never written)

Runs after the library's patterns (norms, losses, attention take their matmuls first). Legal: one
device Triton runs on, fp32/bf16/fp16 operands of one dtype, 2-D or 3-D products, static shapes;
profitable: cost.estimate_gemm_epilogue, and on CUDA with FusionConfig.gemm_timing a timing of the
generated kernel against Inductor's compile of the region alone once per shape (codegen/tuning.py
keeps both).
"""
import dataclasses
import operator
import types

import torch
import torch.fx as fx

from fusion_compiler import _compat, cost
from fusion_compiler.canonical import is_float_cast, val
from fusion_compiler.codegen import gemm as kernels, tuning
from fusion_compiler.codegen.launch import can_launch
from fusion_compiler.decisions import Decision, describe, location
from fusion_compiler.engine import random_like
from fusion_compiler.patterns import collectives
from fusion_compiler.patterns.checks import float_dtype, one_device

FAMILY = "gemm"
NAMES = ("gemm_epilogue", "gemm_reduction")
DESCRIPTORS = tuple(types.SimpleNamespace(name=n, family=FAMILY) for n in NAMES)
KERNEL = "fusion::gemm_epilogue"
aten = torch.ops.aten

ROOTS = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.matmul.default)
_ROW_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
UNARY = {aten.relu.default: "relu", aten.sigmoid.default: "sigmoid", aten.tanh.default: "tanh",
         aten.silu.default: "silu", aten.mish.default: "mish", aten.hardswish.default: "hardswish",
         aten.hardsigmoid.default: "hardsigmoid", aten.exp.default: "exp", aten.abs.default: "abs",
         aten.neg.default: "neg"}
BINARY = {aten.add.Tensor: "add", aten.sub.Tensor: "sub", aten.mul.Tensor: "mul", aten.div.Tensor: "div"}
REDUCE = {aten.sum.dim_IntList: "sum", aten.mean.dim: "mean", aten.amax.default: "amax",
          aten.logsumexp.default: "logsumexp"}
OPS = sorted({*UNARY.values(), *BINARY.values(), "gelu", "gelu_tanh", "leaky_relu", "clamp", "clamp_min",
              "clamp_max", "softplus", "square", "cast"})


@dataclasses.dataclass
class Chain:
    root: fx.Node
    a: fx.Node
    b: fx.Node
    shape: list  # the chain's elementwise shape (the product's, or the row-splitting view's)
    nodes: list = dataclasses.field(default_factory=list)  # root, views, chain ops, in order
    sides: list = dataclasses.field(default_factory=list)
    steps: list = dataclasses.field(default_factory=list)
    reduce: str = ""
    keepdim: bool = False
    cut: str = ""  # where and why the chain stops before its value's users, or ""

    @property
    def last(self) -> fx.Node:
        return self.nodes[-1]

    def epilogue(self) -> kernels.Epilogue:
        return kernels.Epilogue(len(self.sides), tuple(self.steps), self.reduce, self.keepdim)


def _current(chain: Chain) -> tuple:
    return ("v", len(chain.steps) - 1) if chain.steps else ("z",)


def _side(chain: Chain, node: fx.Node) -> tuple | str:
    """The ref of a tensor operand, added as a side input; or why it cannot be one."""
    v, out = val(node), val(chain.last)
    if not isinstance(v, torch.Tensor):
        return f"operand {node.name} has no tensor value"
    # the GEMM would wait for the communication instead of overlapping it (overlap.py)
    if _waited(node) is not None:
        return f"operand {node.name} is a collective's result: the GEMM must not wait for it"
    why = float_dtype(v) or one_device([v, out])
    if why:
        return f"operand {node.name}: {why}"
    if v.dim() > out.dim() or list(torch.broadcast_shapes(v.shape, out.shape)) != list(out.shape):
        return f"operand {node.name} {list(v.shape)} would broadcast the chain {list(out.shape)}"
    if kernels.layout(val(chain.a), val(chain.b), [v], chain.shape) is None:
        return f"operand {node.name} {list(v.shape)} is not readable as the product's [batch, M, N]"
    if node in chain.sides:
        return ("s", chain.sides.index(node))
    chain.sides.append(node)
    return ("s", len(chain.sides) - 1)


def _operand(chain: Chain, arg, cur: fx.Node) -> tuple | str:
    if arg is cur:
        return _current(chain)
    if isinstance(arg, fx.Node):
        return _side(chain, arg)
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return ("c", float(arg))
    return f"operand {arg!r} is not a number or a tensor"


def _numbers(*values) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def _step(chain: Chain, node: fx.Node, cur: fx.Node) -> tuple | str:
    """(op, refs) of an elementwise node applied to the chain's value `cur`, or why not."""
    t, args, kw = node.target, node.args, node.kwargs
    if t in UNARY and len(args) == 1:
        return UNARY[t], (_current(chain),)
    if t is aten.gelu.default:
        return ("gelu_tanh" if kw.get("approximate", "none") == "tanh" else "gelu"), (_current(chain),)
    if t is aten.leaky_relu.default and _numbers(*args[1:]):
        return "leaky_relu", (_current(chain), ("c", float(args[1] if len(args) > 1 else 0.01)))
    if t is aten.softplus.default and tuple(args[1:]) in ((), (1,), (1, 20)):
        return "softplus", (_current(chain),)
    if t is aten.pow.Tensor_Scalar and args[1] == 2:
        return "square", (_current(chain),)
    if t is aten.clamp.default and _numbers(*[a for a in args[1:] if a is not None]) and not kw:
        lo, hi = (list(args[1:]) + [None, None])[:2]
        if lo is not None and hi is not None:
            return "clamp", (_current(chain), ("c", float(lo)), ("c", float(hi)))
        if lo is not None or hi is not None:
            op, bound = ("clamp_min", lo) if lo is not None else ("clamp_max", hi)
            return op, (_current(chain), ("c", float(bound)))
    if t in (aten.clamp_min.default, aten.clamp_max.default) and _numbers(args[1]):
        return t.__name__.split(".")[0], (_current(chain), ("c", float(args[1])))
    if is_float_cast(node):
        return "cast", (_current(chain),)
    if t in BINARY and len(args) == 2 and kw.get("alpha", 1) == 1 and not kw.get("rounding_mode"):
        refs = []
        for arg in args:
            ref = _operand(chain, arg, cur)
            if isinstance(ref, str):
                return ref
            refs.append(ref)
        return BINARY[t], tuple(refs)
    return f"{node.name} ({t}) is not an elementwise op the epilogue generates"


def _product(root: fx.Node) -> tuple | None:
    """(a, b, bias or None) of a GEMM node; None for an addmm that is not bias + a @ b."""
    if root.target is aten.addmm.default:
        bias, a, b = root.args[:3]
        if root.kwargs.get("beta", 1) != 1 or root.kwargs.get("alpha", 1) != 1 or val(bias).dim() > 1:
            return None
        return a, b, bias
    return root.args[0], root.args[1], None


def _reduction(chain: Chain, node: fx.Node, training: bool) -> str | None:
    """Take a reduction over the last dim as the chain's end (None), or say why not."""
    dims = node.args[1] if len(node.args) > 1 else None
    ndim = val(chain.last).dim()
    if list(dims or []) not in ([-1], [ndim - 1]) or node.kwargs.get("dtype") is not None:
        return f"{node.name} reduces over {dims}, not the last dim alone"
    kind = REDUCE[node.target]
    if kind == "amax" and training:
        return f"{node.name}: amax's gradient splits ties; generated only without gradients"
    chain.reduce = kind
    chain.keepdim = bool(node.args[2]) if len(node.args) > 2 else False
    chain.nodes.append(node)
    return None


def find_chain(root: fx.Node, training) -> Chain | None:
    """The maximal chain after the GEMM node `root` (training(node): does it need a gradient)."""
    product = _product(root)
    if product is None:
        return None
    a, b, bias = product
    chain = Chain(root, a, b, list(val(root).shape), nodes=[root])
    if bias is not None:
        ref = _side(chain, bias)
        if isinstance(ref, str):
            return None
        chain.steps.append(("add", (("z",), ref)))
    while True:
        cur = chain.last
        users = list(cur.users)
        if len(users) != 1:
            if len(users) > 1:
                chain.cut = f"{cur.name} has {len(users)} users ({', '.join(u.name for u in users)})"
            return chain
        user = users[0]
        if user.op != "call_function":
            return chain
        if user.target in _ROW_VIEWS and cur is root and _splits_rows(user):
            chain.shape = list(val(user).shape)
            chain.nodes.append(user)
            continue
        if user.target in REDUCE and user.args[0] is cur:
            why = _reduction(chain, user, training(user))
            chain.cut = why or ""
            return chain
        out = val(user)
        if not isinstance(out, torch.Tensor) or list(out.shape) != list(val(cur).shape) or \
                not out.is_floating_point():
            chain.cut = f"{user.name} changes the shape or dtype kind"
            return chain
        step = _step(chain, user, cur)
        if isinstance(step, str):
            chain.cut = step
            return chain
        chain.steps.append(step)
        chain.nodes.append(user)


def _splits_rows(view: fx.Node) -> bool:
    """A view of the 2-D product that keeps its last dim (F.linear on [B, S, K] input)."""
    src, out = val(view.args[0]), val(view)
    return src.dim() == 2 and out.dim() >= 2 and out.shape[-1] == src.shape[-1]


# --- legality, cost, verification ------------------------------------------------------------------
_THROUGH = (*_ROW_VIEWS, aten.t.default, aten.transpose.int, aten.permute.default, aten.expand.default)


def _waited(node: fx.Node) -> fx.Node | None:
    """The collective whose wait gives node (through views), or None."""
    while node.op == "call_function" and node.target in _THROUGH:
        node = node.args[0]
    return node.args[0] if collectives.is_wait(node) and isinstance(node.args[0], fx.Node) else None


def _all_gathered(node: fx.Node) -> bool:
    return "all_gather" in str(getattr(_waited(node), "target", ""))


def _legal(chain: Chain, config) -> str | None:
    a, b = val(chain.a), val(chain.b)
    sides = [val(s) for s in chain.sides]
    tensors = [a, b, *sides]
    why = one_device(tensors) or can_launch(a.device) or float_dtype(a)
    if why:
        return why
    # one dtype for the product: a mixed-dtype matmul is not what eager computes
    if a.dtype != b.dtype:
        return f"operands of dtypes {a.dtype} and {b.dtype}"
    # the kernel's grid and tiles are fixed at compile time
    if any(isinstance(s, torch.SymInt) for t in tensors for s in (*t.shape, *t.stride())):
        return "dynamic shape: the GEMM kernel is specialized to static sizes"
    if any(s == 0 for s in (*a.shape, *b.shape)):
        return "empty product"
    # the collective-overlap pass splits an all-gather + matmul into chunks that overlap (overlap.py)
    if config.overlap_collectives and (_all_gathered(chain.a) or _all_gathered(chain.b)):
        return "an operand is all-gathered: left to the overlap pass (all-gather + matmul in chunks)"
    out = val(chain.last)
    if not chain.reduce and not out.is_contiguous():
        return f"the chain's output has strides {tuple(out.stride())} (the kernel writes contiguous)"
    return None


_VERIFIED: dict = {}


def _verification_inputs(chain: Chain) -> tuple[list, list]:
    """(a, b, sides..., the chain's shape) for the one-time verification run: random tensors of the
    region's own signature on a GPU; under the interpreter (CPU), which runs every program in Python,
    the same dtypes, transposition and broadcasts at sizes of at most 2 x 40 x 48."""
    a, b = val(chain.a), val(chain.b)
    sides = [val(s) for s in chain.sides]
    if a.device.type != "cpu":
        return [random_like(t) for t in (a, b, *sides)], list(chain.shape)
    shape = [min(d, 2) for d in chain.shape[:-1]] + [min(chain.shape[-1], 48)]
    k, rows = min(a.shape[-1], 40), 1
    for d in shape[:-1]:
        rows *= d
    a_shape = [rows, k] if a.dim() == 2 else [*shape[:-1], k]
    lead = [shape[0]] if b.dim() == 3 else []
    transposed = b.stride(-2) == 1 and b.stride(-1) != 1  # F.linear's w.t()
    b_new = torch.randn(*lead, shape[-1], k, dtype=b.dtype).transpose(-2, -1) if transposed else \
        torch.randn(*lead, k, shape[-1], dtype=b.dtype)
    side_new = [torch.randn([1 if d == 1 else shape[len(shape) - t.dim() + i] for i, d in enumerate(t.shape)],
                            dtype=t.dtype) for t in sides]
    return [torch.randn(a_shape, dtype=a.dtype), b_new, *side_new], shape


def _verify(ep: kernels.Epilogue, chain: Chain, out_dtype, save: bool, training: bool,
            side_needs: list) -> str | None:
    """Compile and run the generated kernels once on random data of this signature."""
    a, b = val(chain.a), val(chain.b)
    sides = [val(s) for s in chain.sides]
    key = (ep, out_dtype, save, training, tuple(side_needs),
           *[(tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device)) for t in (a, b, *sides)])
    if key not in _VERIFIED:
        try:
            real, shape = _verification_inputs(chain)
            y, z = kernels.forward(ep, real[0], real[1], real[2:], shape, out_dtype, save)
            if training:
                kernels.backward(ep, torch.randn_like(y), z, y, real[2:], shape, side_needs,
                                 a.dtype, list(real[0].shape), list(real[1].shape))
            _VERIFIED[key] = None
        except Exception as e:  # noqa: BLE001  (a kernel that fails leaves the region to the hand-off)
            _VERIFIED[key] = f"kernel failed on this signature: {type(e).__name__}: {str(e)[:200]}"
    return _VERIFIED[key]


def region(chain: Chain) -> tuple[fx.GraphModule, list]:
    """The region alone, as the hand-off would compile it: the product and the chain's nodes, each
    outside operand a placeholder; with random inputs of the operands' signatures (strides too)."""
    graph, env, inputs = fx.Graph(), {}, []
    for node in chain.nodes:
        for arg in node.all_input_nodes:
            if arg not in env:
                env[arg] = graph.placeholder(f"in{len(inputs)}")
                inputs.append(random_like(val(arg)))
        env[node] = graph.node_copy(node, env.__getitem__)
        env[node].meta = {}  # the outer trace's fake values: Inductor traces the region afresh
    graph.output(env[chain.last])
    return fx.GraphModule(torch.nn.Module(), graph), inputs


def _inductor_ms(chain: Chain, key: str) -> float:
    """Inductor's time for the region alone (its product and its epilogue kernel, forward), timed as
    our kernel is, once per signature (kept with the tuning entries)."""
    known = tuning.entry(key)
    if known is None:
        gm, inputs = region(chain)
        with _compat.tracing(None), torch.no_grad():  # a compile of its own, outside Dynamo's
            compiled = _compat.compile_fx(gm, inputs)
            known = {"ms": kernels._bench(lambda: compiled(*inputs))}
        tuning.record(key, known)
    return known["ms"]


def _timed(ep, chain: Chain, out_dtype, save: bool, ctx) -> cost.Estimate:
    """Our generated kernel (tuned) against Inductor's compile of the same region, both timed on random
    data of this signature; where Inductor fails on the region alone, cuBLAS's timed product plus one
    pass at the copy bandwidth stands in for it."""
    a, b = val(chain.a), val(chain.b)
    sides = [val(s) for s in chain.sides]
    real = [random_like(t) for t in (a, b, *sides)]
    found = kernels.tune(ep, real[0], real[1], real[2:], chain.shape, out_dtype, save)
    operands, side_bytes = cost.nbytes(a) + cost.nbytes(b), sum(map(cost.nbytes, sides))
    io = operands + side_bytes + cost.nbytes(val(chain.last))
    product = a.element_size() * val(chain.root).numel()
    backward = cost.gemm_backward_s(2.0 * val(chain.root).numel() * a.shape[-1], operands, product, side_bytes,
                                    ctx.profile)
    lay = kernels.layout(real[0], real[1], real[2:], chain.shape)
    try:
        handoff, how = _inductor_ms(chain, "inductor|" + kernels.tuning_key(ep, lay, False)) * 1e-3, "Inductor"
    except Exception as e:  # noqa: BLE001  (the region alone may not compile; the estimate stands in)
        p = ctx.profile
        handoff = found["cublas_ms"] * 1e-3 + p.launch_s + (product + io - operands) / p.bandwidth
        how = f"cuBLAS + epilogue pass (Inductor failed on the region alone: {type(e).__name__})"
    return cost.timed_gemm_epilogue(found["ms"] * 1e-3, handoff, how,
                                    io + (product if save else 0), io + 2 * product, backward, ctx)


# --- the pass -------------------------------------------------------------------------------------------
def rewrite(gm: fx.GraphModule, config, log, gid: int, needs_grad: set) -> int:
    """Fuse every GEMM's chain that is legal and pays; one decision row per chain. Returns the count."""
    applied = 0
    for root in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ROOTS]:
        if root.graph is not gm.graph or not isinstance(val(root), torch.Tensor):
            continue
        product = _product(root)
        if product is None or kernels.layout_check(val(product[0]), val(product[1])):
            continue  # not a product this family computes (4-D attention scores, ...): no candidate
        chain = find_chain(root, needs_grad.__contains__)
        if chain is None or not (chain.reduce or len(chain.steps) > (root.target is aten.addmm.default)):
            continue  # nothing after the product (cuBLAS's addmm adds the bias itself)
        desc = DESCRIPTORS[1] if chain.reduce else DESCRIPTORS[0]
        if not config.enables(desc):
            continue
        row, done = _decide(gm, chain, desc, config, gid, needs_grad)
        log.add(row)
        applied += done
    if applied:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return applied


def _row(gid, desc, chain: Chain, verdict: str, reason: str, estimate=None) -> Decision:
    inputs = [val(chain.a), val(chain.b), *[val(s) for s in chain.sides]]
    return Decision(gid, desc.name, FAMILY, verdict, reason, location(chain.root), tuple(describe(v) for v in inputs),
                    bytes_saved=estimate.bytes_saved if estimate else None,
                    time_saved_us=round(estimate.time_saved_s * 1e6, 2) if estimate else None, kernel=KERNEL)


_DOWNSTREAM_FUSERS = (*REDUCE, aten.amin.default, aten.max.dim, aten.min.dim, aten._softmax.default,
                      aten._log_softmax.default)


def _fusable_consumer(chain: Chain) -> fx.Node | None:
    """The chain's sole consumer when Inductor would fuse it with the epilogue (a pointwise op or a
    reduction the chain could not take): fusing the chain would write the output for it to read back."""
    users = list(chain.last.users)
    if len(users) != 1 or users[0].op != "call_function":
        return None
    user = users[0]
    pointwise = torch.Tag.pointwise in getattr(user.target, "tags", ())
    return user if pointwise or user.target in _DOWNSTREAM_FUSERS else None


def _decide(gm, chain: Chain, desc, config, gid, needs_grad) -> tuple[Decision, int]:
    cut = f"; chain cut: {chain.cut}" if chain.cut else ""
    why = _legal(chain, config)
    if why:
        return _row(gid, desc, chain, "rejected", why + cut), 0
    ep = chain.epilogue()
    training = chain.last in needs_grad
    side_needs = [s in needs_grad for s in chain.sides]
    save = training and ep.backward_reads_product(side_needs)
    out_dtype = val(chain.last).dtype
    a = val(chain.a)
    ctx = cost.CostContext.of(a.device, config, training)
    calls = 2 if training else 1  # fusion::gemm_epilogue, and its backward
    estimate = cost.with_host_time(cost.estimate_gemm_epilogue(a, val(chain.b), [val(s) for s in chain.sides],
                                                               chain.shape, val(chain.last), len(ep.steps), save, ctx),
                                   calls, ctx)
    roofline = config.cost_model == "roofline"
    consumer = _fusable_consumer(chain) if chain.cut else None
    if roofline and consumer is not None and config.baseline == "inductor":
        return _row(gid, desc, chain, "rejected", f"its consumer {consumer.name} would fuse with the epilogue in "
                    f"Inductor's kernel; fused here, the output is written for it to read back{cut}", estimate), 0
    if roofline and not estimate.profitable:
        return _row(gid, desc, chain, "rejected", estimate.reason() + cut, estimate), 0
    if roofline and _times(config, a.device):  # first, so that verification runs this epilogue's own tile
        try:
            estimate = cost.with_host_time(_timed(ep, chain, out_dtype, save, ctx), calls, ctx)
        except Exception as e:  # noqa: BLE001  (no tile of the sweep compiles with this epilogue)
            return _row(gid, desc, chain, "rejected", f"no tuned tile compiles with this epilogue: "
                        f"{type(e).__name__}: {str(e)[:200]}{cut}", estimate), 0
        if not estimate.profitable:
            return _row(gid, desc, chain, "rejected", estimate.reason() + cut, estimate), 0
    if config.verify_kernels:
        failure = _verify(ep, chain, out_dtype, save, training, side_needs)
        if failure:
            return _row(gid, desc, chain, "rejected", failure + cut, estimate), 0
    _replace(gm, chain, ep, out_dtype, save)
    reason = estimate.reason() if roofline else f"cost model off (cost_model='always'); {estimate.reason()}"
    ops = ", ".join(op for op, _ in ep.steps) + (f", {ep.reduce}" if ep.reduce else "")
    return _row(gid, desc, chain, "applied", f"[{ops}] in the GEMM's epilogue; {reason}{cut}", estimate), 1


def _times(config, device: torch.device) -> bool:
    """Whether decisions on `device` time the kernels (FusionConfig.gemm_timing; CUDA only)."""
    return config.gemm_timing and device.type == "cuda"


def _replace(gm: fx.GraphModule, chain: Chain, ep: kernels.Epilogue, out_dtype, save: bool) -> None:
    graph, last = gm.graph, chain.last
    args = (ep.text(), chain.a, chain.b, list(chain.sides), list(chain.shape), out_dtype, save)
    with graph.inserting_before(last):
        call = graph.call_function(torch.ops.fusion.gemm_epilogue.default, args)
        out = graph.call_function(operator.getitem, (call, 0))
    y = val(last)  # the op's output has the replaced node's shape and dtype
    product = val(chain.root).new_empty(chain.shape if save else (0,))
    call.meta["val"], out.meta["val"] = (y, product), y
    for node in (call, out):
        if "stack_trace" in chain.root.meta:
            node.meta["stack_trace"] = chain.root.meta["stack_trace"]
    last.replace_all_uses_with(out)
