"""FP8 family (opt-in, FusionConfig(fp8=recipe)): linears become FP8 GEMMs where the cost model says
they pay.

    before:  y = F.linear(x, w)                              (mm(x, w.t()), 2-D after F.linear's view)
    after:   y = fusion.fp8_linear(x, w, recipe, emulate)     (per-row recipes: forward, dx and dW in FP8)
             qx, qx_t, sx = fusion.fp8_quantize_tensorwise(x, training, emulate)   (tensorwise: one cast
             qw, qw_t, sw = fusion.fp8_quantize_tensorwise(w, training, emulate)    of each x and w, both
             y = fusion.fp8_linear_tensorwise(x, w, qx, qx_t, sx, qw, qw_t, sw, emulate)   layouts; ops/fp8.py)

Per GEMM, `cost.estimate_fp8_linear` weighs the FP8 GEMMs (at the card's measured FP8 rate, with
their tile waves) plus the quantization passes (each operand read once and written in FP8, both
layouts in training) against the high-precision GEMMs on cuBLAS; small or skinny products, where
the passes cost more than the faster GEMM saves, keep their dtype and the row says why.
Legal: a CUDA GPU of compute capability >= 8.9 (or FusionConfig(fp8_emulate=True), which computes
the recipe's rounding in higher precision on any device), fp32/bf16/fp16 operands of one dtype,
static sizes that are multiples of 16 (torch._scaled_mm's), bf16 for the rowwise recipes (their
scaled GEMM returns bf16 only). Linears with a bias (addmm) are left alone. In training, the linear
that makes a softmax's logits (the LM head) keeps its dtype under recipes with e4m3 gradients: its
output gradient, softmax - one-hot, spans more than e4m3 keeps within one row's scale (the small
probabilities flush to zero). Measured (benchmarks/RESULTS.md, stop 29): a 4-layer Llama on text
ended 8.7% above bf16 with its LM head in rowwise FP8, 5.0% with it in bf16; torchao's and
torchtitan's float8 recipes leave the output projection out as well.

Per-row recipes cast a linear's input where it is made: a fusion RMSNorm or GLU writes its output's
FP8 copy in the same kernel (their `_fp8` twins; the norm and GLU decisions credit the casts this
saves, `with_cast_credit`); an input that an aten op Inductor generates makes (pointwise or a copy)
gets the cast as torch ops, which Inductor fuses into that kernel. Under every recipe an
input several linears read is cast once for all of them (tensorwise: a weight too).

Tensorwise, in training: an LM head's cross-entropy joins it in one op whose backward writes the
logits' gradient in FP8 (patterns/fp8_loss.py).

Runs after the library's patterns (the LM head + loss, attention take their products first) and
before the GEMM epilogue pass.
"""
import dataclasses
import operator
import types

import torch
import torch.fx as fx

from torch.fx.experimental.proxy_tensor import make_fx

from fusion_compiler import _compat, cost
from fusion_compiler.canonical import val
from fusion_compiler.codegen.fp8 import ROW_MAX, quantize_reference
from fusion_compiler.decisions import Decision, describe, location
from fusion_compiler.ops import fp8 as fp8_op
from fusion_compiler.patterns import fp8_loss
from fusion_compiler.patterns.checks import float_dtype, one_device
from fusion_compiler.patterns.gemm_horizontal import linear_operands

DESCRIPTOR = types.SimpleNamespace(name="fp8_linear", family="fp8")
KERNELS = {True: "fusion::fp8_linear", False: "fusion::fp8_linear_tensorwise"}  # by the recipe's per_row
MIN_CAPABILITY = (8, 9)
aten = torch.ops.aten


def _hardware(device: torch.device, emulate: bool) -> str | None:
    if emulate:
        return None
    if device.type != "cuda":
        return (f"FP8 GEMMs need a CUDA GPU of compute capability >= 8.9, not {device.type} "
                "(FusionConfig(fp8_emulate=True) emulates the recipe)")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return f"FP8 GEMMs need compute capability >= 8.9, this GPU has {capability[0]}.{capability[1]}"
    return None


def _legal(x: torch.Tensor, w: torch.Tensor, recipe: str, emulate: bool) -> str | None:
    why = one_device([x, w]) or float_dtype(x) or _hardware(x.device, emulate)
    if why:
        return why
    if w.dtype != x.dtype:
        return f"weight {w.dtype} and input {x.dtype} differ"
    if fp8_op.recipe(recipe).per_row and x.dtype != torch.bfloat16:
        return f"recipe {recipe}: torch._scaled_mm's per-row scaling returns bfloat16 only, the linear is {x.dtype}"
    sizes = (*x.shape, w.shape[0])
    if any(isinstance(s, torch.SymInt) for s in sizes):
        return "symbolic (dynamic) sizes"
    if any(s % 16 for s in sizes):
        return f"M, K, N = {sizes[0]}, {sizes[1]}, {sizes[2]}: torch._scaled_mm needs multiples of 16"
    return None


# what a linear's logits pass through on their way to the softmax, and the softmaxes
_PASSIVE = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten._to_copy.default,
            aten.clone.default, aten.slice.Tensor, aten.alias.default, aten.contiguous.default)
_SOFTMAX = (aten._log_softmax.default, aten._softmax.default, torch.ops.fusion.cross_entropy.default)


def _makes_logits(node: fx.Node, hops: int = 8) -> bool:
    """Does node's output reach a softmax (or cross-entropy) through views, casts and slices only?"""
    frontier = [node]
    for _ in range(hops):
        nxt = []
        for n in frontier:
            for user in n.users:
                if user.op != "call_function":
                    continue
                if user.target in _SOFTMAX and user.args[0] is n:
                    return True
                if user.target in _PASSIVE:
                    nxt.append(user)
        frontier = nxt
    return False


def _logits_rule(node: fx.Node, recipe: fp8_op.Recipe, training: bool) -> str | None:
    """Why the linear `node` keeps its dtype as a softmax's logits in training, or None."""
    if training and recipe.grad_dtype == torch.float8_e4m3fn and _makes_logits(node):
        return ("the linear makes a softmax's logits (an LM head): its output gradient, softmax - one-hot, spans "
                "more than e4m3 keeps within a row's scale (small probabilities flush to zero); it keeps its dtype "
                "in training under recipes with e4m3 gradients (the tensorwise recipe's are e5m2)")
    return None


def _row(gid, node, verdict, reason, inputs, estimate=None, per_row=True) -> Decision:
    return Decision(gid, DESCRIPTOR.name, DESCRIPTOR.family, verdict, reason, location(node),
                    tuple(describe(v) for v in inputs),
                    bytes_saved=estimate.bytes_saved if estimate else None,
                    time_saved_us=round(estimate.time_saved_s * 1e6, 2) if estimate else None, kernel=KERNELS[per_row])


# the kernels that can also write their output's FP8 copy (by rows), and their twins that do
_NORMS = {torch.ops.fusion.rms_norm.default: torch.ops.fusion.rms_norm_fp8.default,
          torch.ops.fusion.add_rms_norm.default: torch.ops.fusion.add_rms_norm_fp8.default}
_GLUS = {torch.ops.fusion.glu.default: torch.ops.fusion.glu_fp8.default,
         torch.ops.fusion.glu_packed.default: torch.ops.fusion.glu_packed_fp8.default}
_TWINS = {**_NORMS, **_GLUS}
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _key(a: fx.Node) -> fx.Node:
    """The tensor a linear's 2-D input `a` holds the rows of: F.linear on [B, S, K] views x as
    [B*S, K] once per linear, so linears of one x have one key."""
    if a.op == "call_function" and a.target in _VIEWS and isinstance(a.args[0], fx.Node):
        src = val(a.args[0])
        if src.is_contiguous() and src.dim() >= 2 and src.shape[-1] == val(a).shape[1]:
            return a.args[0]
    return a


def _dtype_only(cast: fx.Node) -> bool:
    a, b = val(cast.args[0]), val(cast)
    return a.device == b.device and a.layout == b.layout and cast.kwargs.get("memory_format") is None \
        and a.is_contiguous() == b.is_contiguous()


def _uncast(src: fx.Node) -> fx.Node:
    """What src is an exact cast of: through casts to fp32/fp64 and back to src's dtype."""
    dtype = val(src).dtype
    while src.op == "call_function" and src.target is aten._to_copy.default and _dtype_only(src) \
            and val(src.args[0]).dtype in (dtype, torch.float32, torch.float64):
        src = src.args[0]
    return src


def _producer(src: fx.Node) -> fx.Node | None:
    """The fusion kernel whose output y `src` is, if it can write y's FP8 copy too: a RMSNorm (y its
    output 0) or a GLU (rows of at most ROW_MAX, cast from registers); src is y itself, or an exact
    cast of y (`_uncast`)."""
    dtype = val(src).dtype
    src = _uncast(src)
    if src.op != "call_function" or val(src).dtype != dtype or not val(src).is_contiguous():
        return None
    if src.target in _GLUS:
        return src if val(src).shape[-1] <= ROW_MAX else None
    norm = src.args[0] if src.target is operator.getitem and src.args[1] == 0 else None
    return norm if isinstance(norm, fx.Node) and norm.op == "call_function" and norm.target in _NORMS else None


_COPIES = (aten.clone.default, aten._to_copy.default)


def _inductor_made(src: fx.Node) -> fx.Node | None:
    """The aten op, through views, whose kernel Inductor generates and that makes src: a pointwise op
    or a copy (such as the contiguous copy of attention's transposed output). Given the per-row cast
    as torch ops (`_inductor_cast`), Inductor computes it in that kernel: the row's amax as a
    reduction, the FP8 copy and its scale written beside src. Measured on the H100 (stop 39,
    benchmarks/fp8_inductor_cast.py): the forward 2-6% faster than our cast after Inductor's kernel
    behind a copy, a GELU and an RMSNorm in torch ops; behind a LayerNorm 1.6-2.7% slower, so a
    LayerNorm's output (an output of native_layer_norm, not matched here) keeps our cast."""
    while src.op == "call_function" and isinstance(src.args[0], fx.Node) and \
            (src.target in _VIEWS or getattr(src.target, "is_view", False)):
        src = src.args[0]
    if src.op != "call_function" or not isinstance(src.target, _compat.OpOverload) or src.target.namespace != "aten":
        return None
    return src if torch.Tag.pointwise in src.target.tags or src.target in _COPIES else None


def _rows_cast(rows: torch.Tensor) -> tuple:
    return quantize_reference(rows.detach(), fp8_op.E4M3)


def _inductor_cast(graph: fx.Graph, before: fx.Node, src: fx.Node) -> tuple:
    """(q, scale) of src's rows in e4m3, as torch ops (codegen/fp8.py's `quantize_reference`, traced)
    inserted before `before`: Inductor fuses them into the kernel that makes src."""
    rows = _rows_view(graph, before, src)
    traced = make_fx(_rows_cast)(val(rows))
    arg = next(n for n in traced.graph.nodes if n.op == "placeholder")
    with graph.inserting_before(before):
        return tuple(graph.graph_copy(traced.graph, {arg: rows}))


def _readers(y: fx.Node, config, needs_grad: set) -> list:
    """(mm node, input, weight) of the bias-free linears that read y (or F.linear's 2-D view of it)
    and may run in FP8."""
    found, recipe = [], fp8_op.recipe(config.fp8)
    for src in _cast_forms(y):
        for user in src.users:
            views = user.users if user.op == "call_function" and user.target in _VIEWS else ()
            for node in (user, *views):
                parts = linear_operands(node) if node.op == "call_function" and node.target is aten.mm.default else None
                if parts and _key(parts[0]) is src and \
                        not _legal(val(parts[0]), val(parts[1]), config.fp8, config.fp8_emulate) and \
                        not _logits_rule(node, recipe, node in needs_grad):
                    found.append((node, parts[0], parts[1]))
    return found


def _cast_forms(y: fx.Node) -> list:
    """y and the casts of it that `_uncast` reads back to y (the user's cast to fp32 and back, or a
    norm's output computed in fp32 and cast to the linears' dtype)."""
    reached = [y]
    for node in reached:
        reached += [u for u in node.users if u.op == "call_function" and u.target is aten._to_copy.default
                    and _dtype_only(u)]
    return [n for n in reached if _uncast(n) is y]


def with_cast_credit(estimate: cost.Estimate, y: fx.Node, config, needs_grad: set) -> cost.Estimate:
    """The estimate of a norm or GLU region (a pattern with fp8_producer) whose fusion kernel would
    also write y's FP8 copy by rows: the FP8 linears reading y then skip their cast of it, so the
    hand-off side is charged what those casts cost there: each linear casting y itself (one cast
    shared when several read it), or, where only the fused cast makes FP8 pay, the linear in 16 bits.
    Linears the cost model would not take in FP8 even with the fused cast earn nothing. The FP8 pass
    then plans these casts exactly so (`_cast_plans`)."""
    if config.fp8 is None or not config.enables(DESCRIPTOR) or not config.fp8_fuse_cast \
            or not fp8_op.recipe(config.fp8).per_row:
        return estimate
    if val(y).shape[-1] > ROW_MAX or not val(y).is_contiguous():
        return estimate
    readers, credit, paid = _readers(y, config, needs_grad), 0.0, 0
    for node, a, w in readers:
        x, wv = val(a), val(w)
        ctx = cost.CostContext.of(x.device, config, node in needs_grad)
        fused, alone = (cost.estimate_fp8_linear(x.shape[0], wv.shape[0], x.shape[1], x.element_size(), True, ctx,
                                                 x_cast=how, readers=len(readers))
                        for how in ("fused", "own" if len(readers) == 1 else "shared"))
        if fused.profitable:
            credit += (alone.ours_s if alone.profitable else alone.baseline_s) - fused.ours_s
            paid += 1
    if credit <= 0:
        return estimate
    note = f"writing its FP8 copy saves {paid} FP8 linear(s) reading it {credit * 1e6:.1f} us of casts"
    return dataclasses.replace(estimate, baseline_s=estimate.baseline_s + credit,
                               note=f"{estimate.note}; {note}" if estimate.note else note)


def _cast_plans(taken: list, config) -> dict:
    """Where each taken linear's input gets its FP8 copy. Keyed by the input's source (the tensor
    before F.linear's view): ("fused", producer node, readers) when a fusion RMSNorm or GLU produced it
    (`_producer`; per-row recipes), ("inductor", first reader's mm node, readers) when an aten op
    Inductor generates made it (`_inductor_made`; per-row recipes), ("shared", first reader's mm node,
    readers) when two or more linears read it, else absent (the linear casts x itself). `taken` holds
    (mm node, input, weight) in graph order. Per-row recipes with FusionConfig(fp8_fuse_cast=False): none."""
    per_row = fp8_op.recipe(config.fp8).per_row
    if per_row and not config.fp8_fuse_cast:
        return {}
    groups: dict = {}
    for node, a, w in taken:
        groups.setdefault(_key(a), []).append(node)
    plans = {}
    for key, readers in groups.items():
        producer = _producer(key) if per_row else None
        if producer is not None:
            plans[key] = ("fused", producer, len(readers))
        elif per_row and _inductor_made(key) is not None:
            plans[key] = ("inductor", readers[0], len(readers))
        elif len(readers) > 1:
            plans[key] = ("shared", readers[0], len(readers))
    return plans


def _emit_casts(gm: fx.GraphModule, plans: dict, config) -> dict:
    """Rewrite each plan into the graph; {source: (q node, scale node)}, keyed by the plans' sources
    (a GLU's source is the GLU node itself, erased here: look casts up by the keys taken before)."""
    graph, casts, swapped = gm.graph, {}, {}
    for src, (how, node, _) in plans.items():
        if how == "fused":
            producer = node
            if producer not in swapped:
                twin = _TWINS[producer.target]
                with graph.inserting_after(producer):
                    fused = graph.call_function(twin, producer.args, producer.kwargs)
                fused.meta.update(producer.meta)
                fused.meta["val"] = twin(*[val(a) if isinstance(a, fx.Node) else a for a in producer.args])
                if producer.target in _GLUS:  # y alone -> (y, q, scale)
                    with graph.inserting_after(fused):
                        y = graph.call_function(operator.getitem, (fused, 0))
                    y.meta["val"] = fused.meta["val"][0]
                    producer.replace_all_uses_with(y)
                else:  # (y, ..., rstd) -> the same + (q, scale)
                    producer.replace_all_uses_with(fused)
                graph.erase_node(producer)
                swapped[producer] = fused
            fused = swapped[producer]
            n_out = len(fused.meta["val"])
            with graph.inserting_after(fused):
                scale = graph.call_function(operator.getitem, (fused, n_out - 1))
                q = graph.call_function(operator.getitem, (fused, n_out - 2))
            q.meta["val"], scale.meta["val"] = fused.meta["val"][-2], fused.meta["val"][-1]
        elif how == "inductor":
            q, scale = _inductor_cast(graph, node, src)
        else:  # before the first reader
            q, scale = _call_outputs(graph, node, torch.ops.fusion.fp8_quantize_rows.default,
                                     (_rows_view(graph, node, src), config.fp8_emulate))
        casts[src] = (q, scale)
    return casts


def _rows_view(graph: fx.Graph, before: fx.Node, src: fx.Node) -> fx.Node:
    """A view [-1, K] of src inserted before `before`: the 2-D operand of a cast its readers share."""
    with graph.inserting_before(before):
        rows = graph.call_function(aten.view.default, (src, [-1, val(src).shape[-1]]))
    rows.meta["val"] = val(src).view(-1, val(src).shape[-1])
    return rows


def _call_outputs(graph: fx.Graph, before: fx.Node, op, args: tuple) -> tuple:
    """op(*args) inserted before `before`; a getitem node per output (values in meta)."""
    with graph.inserting_before(before):
        call = graph.call_function(op, args)
        call.meta["val"] = op(*[val(a) if isinstance(a, fx.Node) else a for a in args])
        outs = tuple(graph.call_function(operator.getitem, (call, i)) for i in range(len(call.meta["val"])))
    for out, value in zip(outs, call.meta["val"]):
        out.meta["val"] = value
    return outs


def _plan_note(plan, src: fx.Node) -> str:
    if plan is None:
        return ""
    how, node, n = plan
    if how == "fused":
        return f"; x cast to FP8 in {_TWINS[node.target].name()}, the kernel producing it ({n} linear(s) read it)"
    if how == "inductor":
        return (f"; x cast to FP8 by torch ops that Inductor fuses into the kernel of {_inductor_made(src).target} "
                f"producing it ({n} linear(s) read it)")
    return f"; x cast to FP8 once for the {n} linears that read it"


def _emit_rowwise(gm: fx.GraphModule, taken: list, plans: dict, config, needs_grad: set):
    """(mm node, its fp8_linear call) of each linear taken, the planned casts emitted first."""
    casts = _emit_casts(gm, plans, config)
    for node, a, w, _ in taken:
        with gm.graph.inserting_before(node):
            call = gm.graph.call_function(torch.ops.fusion.fp8_linear.default,
                                          (a, w, config.fp8, config.fp8_emulate, *casts.get(_key(a), ())))
        call.meta["val"] = val(node)
        yield node, call


def _emit_tensorwise(gm: fx.GraphModule, taken: list, plans: dict, config, needs_grad: set):
    """(mm node, its fp8_linear_tensorwise call) of each linear taken: one fp8_quantize_tensorwise per
    input source and per weight, before the first linear reading it, with the transposed layout when
    one of its readers is differentiated; for a weight, not where the backward casts it again (`_recast`)."""
    readers: dict = {}
    for node, a, w, _ in taken:
        for key in (_key(a), w):
            readers.setdefault(key, []).append(node)
    casts = {}
    for node, a, w, _ in taken:
        for key, operand in ((_key(a), a), (w, w)):
            if key not in casts:
                transposed = any(r in needs_grad for r in readers[key]) and not (key is w and _recast(w, config))
                rows = operand if key is operand else _rows_view(gm.graph, node, key)
                casts[key] = _call_outputs(gm.graph, node, torch.ops.fusion.fp8_quantize_tensorwise.default,
                                           (rows, transposed, config.fp8_emulate))
        with gm.graph.inserting_before(node):
            call = gm.graph.call_function(torch.ops.fusion.fp8_linear_tensorwise.default,
                                          (a, w, *casts[_key(a)], *casts[w], config.fp8_emulate))
        call.meta["val"] = val(node)
        yield node, call


def _recast(w: fx.Node, config) -> bool:
    """Does the backward cast weight w again rather than hold its FP8 transpose? Under prefer_memory,
    for a graph input (a parameter: saving it costs nothing; a weight computed in the graph, such as
    autocast's copy, would be held in 16 bits, more than its FP8 transpose)."""
    return config.prefer_memory and w.op in ("placeholder", "get_attr")


def rewrite(gm: fx.GraphModule, config, log, gid: int, needs_grad: set) -> int:
    """Rewrite every bias-free linear that is legal and pays; one decision row each."""
    if config.fp8 is None or not config.enables(DESCRIPTOR):
        return 0
    recipe = fp8_op.recipe(config.fp8)
    legal = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.mm.default:
            continue
        found = linear_operands(node)
        if found is None:
            continue
        a, w, _ = found
        why = _legal(val(a), val(w), config.fp8, config.fp8_emulate) or _logits_rule(node, recipe, node in needs_grad)
        if why:
            log.add(_row(gid, node, "rejected", why, [val(a), val(w)], per_row=recipe.per_row))
            continue
        legal.append((node, a, w))
    plans = _cast_plans(legal, config)
    taken = []
    for node, a, w in legal:
        x_val, w_val = val(a), val(w)
        plan = plans.get(_key(a))
        ctx = cost.CostContext.of(x_val.device, config, node in needs_grad)
        how = plan[0] if plan else "own"
        x_cast = "fused" if how == "inductor" else how  # Inductor's kernel writes it beside x: a fused cast
        estimate = cost.estimate_fp8_linear(x_val.shape[0], w_val.shape[0], x_val.shape[1], x_val.element_size(),
                                            recipe.per_row, ctx, x_cast=x_cast,
                                            readers=plan[2] if plan else 1)
        if config.cost_model == "roofline" and not estimate.profitable:
            log.add(_row(gid, node, "rejected", f"recipe {config.fp8}; {estimate.reason()}", [x_val, w_val], estimate,
                         recipe.per_row))
            continue
        taken.append((node, a, w, estimate))
    # the casts planned for the linears taken (a plan that lost readers to the cost model is re-made)
    plans = _cast_plans([(node, a, w) for node, a, w, _ in taken], config)
    keys = {node: _key(a) for node, a, _, _ in taken}
    emit = _emit_rowwise if recipe.per_row else _emit_tensorwise
    calls = {}
    for node, call in emit(gm, taken, plans, config, needs_grad):
        if "stack_trace" in node.meta:
            call.meta["stack_trace"] = node.meta["stack_trace"]
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        calls[node] = call
    notes = {}
    if not recipe.per_row:  # an LM head's cross-entropy joins it (patterns/fp8_loss.py)
        for node in calls:
            if node in needs_grad:
                calls[node], notes[node] = fp8_loss.fuse(gm, calls[node], config)
    for node, a, w, estimate in taken:
        x_val, w_val = val(a), val(w)
        reason = estimate.reason() if config.cost_model == "roofline" else \
            f"cost model off (cost_model='always'); {estimate.reason()}"
        mode = ", emulated" if config.fp8_emulate else ""
        why = f"recipe {config.fp8}{mode}; {reason}{_plan_note(plans.get(keys[node]), keys[node])}"
        if notes.get(node):
            why += "; " + notes[node]
        log.add(_row(gid, calls[node], "applied", why, [x_val, w_val], estimate, recipe.per_row))
    if taken:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return len(taken)
