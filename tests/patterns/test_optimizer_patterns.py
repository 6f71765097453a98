"""Optimizer family: compiled optimizer steps against eager torch.optim, 5 steps, fresh gradients.

Tolerance for fp32 (stated in the issue as "bitwise-close"): every parameter and state tensor within
atol 1e-6 + rtol 1e-5 of eager after 5 steps. The kernel computes the same ops in the same order in
fp32, with IEEE division and square root; what differs is FMA contraction in the generated code and,
for a float lr scheduled between steps, the step size computed from a float64 tensor instead of a
Python float (1-2 ulp per step). bf16/fp16 parameters: each op's result is rounded to its dtype as
eager does (the interpreter rounds like the GPU, tests/interpreter.py), but an op's fp32 internals
differ (lerp's formula, FMA contraction): one ulp on a bf16 moment moves the step, 2 ulps (rtol 1.6e-2).
"""
import inspect

import pytest
import torch

import fusion_compiler as fc
from fusion_compiler.codegen import launch, multi_tensor

ALWAYS = dict(handoff="aot_eager", cost_model="always")
SHAPES = [(33, 17), (7,), (1,), (0,), (5, 3, 2), ()]  # odd sizes, one element, empty, 0-dim
FP32 = dict(atol=1e-6, rtol=1e-5)


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023) as users write it: sign of an interpolated momentum."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["exp_avg"] = torch.zeros_like(p)

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                exp_avg = self.state[p]["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = exp_avg.mul(beta1).add(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)


OPTIMIZERS = {
    "adam": (lambda ps, fe: torch.optim.Adam(ps, lr=0.01, weight_decay=0.1, foreach=fe), "optimizer_adam"),
    "adamw": (lambda ps, fe: torch.optim.AdamW(ps, lr=0.01, foreach=fe), "optimizer_adam"),
    "adamw_amsgrad": (lambda ps, fe: torch.optim.AdamW(ps, lr=0.01, amsgrad=True, foreach=fe),
                      "optimizer_adam_amsgrad"),
    "sgd_momentum": (lambda ps, fe: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01, foreach=fe),
                     "optimizer_sgd_momentum"),
    "sgd_nesterov": (lambda ps, fe: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, foreach=fe),
                     "optimizer_sgd_momentum"),
    "sgd": (lambda ps, fe: torch.optim.SGD(ps, lr=0.05, foreach=fe), "optimizer_sgd"),
    "lion": (lambda ps, fe: Lion(ps), "optimizer_lion"),
}


def _params(shapes=SHAPES, dtype=torch.float32):
    return [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in shapes]


def _twins(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _grads(params, scale=1.0):
    return [torch.randn(p.shape, dtype=p.dtype) * scale for p in params]


def _set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()


def _assert_state_equal(ref_opt, opt, **tol):
    ref_state, state = ref_opt.state_dict()["state"], opt.state_dict()["state"]
    assert ref_state.keys() == state.keys()
    for key in ref_state:
        for name, value in ref_state[key].items():
            torch.testing.assert_close(state[key][name], value, **tol, msg=lambda m: f"state {key}.{name}: {m}")


def _run(make_opt, params, steps=5, config=None, step_fn=None, scheduler=False, grad_scale=1.0):
    """Eager and compiled optimizers from the same start, the same fresh gradients each step."""
    ref, ours = params, _twins(params)
    ref_opt, opt = make_opt(ref), make_opt(ours)
    be = fc.backend(**(config or ALWAYS))
    step = step_fn or (lambda o, ps: o.step())
    compiled = torch.compile(step, backend=be)
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.8) for o in (ref_opt, opt)] if scheduler else []
    for _ in range(steps):
        grads = _grads(ref, grad_scale)
        _set_grads(ref, grads)
        _set_grads(ours, grads)
        step(ref_opt, ref)
        compiled(opt, ours)
        for s in scheds:
            s.step()
    return ref, ours, ref_opt, opt, be


def _applied(be):
    return [d.pattern for d in be.log.decisions if d.verdict == "applied"]


@pytest.mark.parametrize("foreach", [False, True], ids=["for_loop", "foreach"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_steps_match_eager(name, foreach):
    make, pattern = OPTIMIZERS[name]
    ref, ours, ref_opt, opt, be = _run(lambda ps: make(ps, foreach), _params())
    for r, o in zip(ref, ours):
        torch.testing.assert_close(o, r, **FP32)
    _assert_state_equal(ref_opt, opt, **FP32)
    assert pattern in _applied(be), be.log.decisions
    ops = [n.target for gm in be.rewritten for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.fusion.multi_tensor_apply.default in ops


def test_one_launch_for_all_tensors_of_a_dtype_and_one_per_group():
    """Two param groups with different weight decay, two dtypes: one launch per (group, dtype)."""
    ps = _params([(9, 4), (3,), (70,)]) + _params([(6, 2), (5,)], dtype=torch.bfloat16)

    def make(params):
        return torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}],
                                 lr=0.01, foreach=False)

    ref, ours, ref_opt, opt, be = _run(make, ps)
    for r, o in zip(ref, ours):
        tol = FP32 if r.dtype == torch.float32 else dict(atol=2e-2, rtol=1.6e-2)
        torch.testing.assert_close(o, r, **tol)
    calls = [n for n in be.rewritten[-1].graph.nodes if n.target == torch.ops.fusion.multi_tensor_apply.default]
    # group 0 (fp32 x2), group 1 fp32 (x1), group 1 bf16 (x2)
    assert sorted(len(c.args[2]) // 3 for c in calls) == [1, 2, 2]


def test_bf16_params_match_eager_rounding():
    ps = _params([(40, 3), (17,)], dtype=torch.bfloat16)
    ref, ours, ref_opt, opt, _ = _run(lambda p: torch.optim.AdamW(p, lr=0.01, foreach=True), ps)
    for r, o in zip(ref, ours):
        torch.testing.assert_close(o, r, atol=2e-2, rtol=1.6e-2)
    _assert_state_equal(ref_opt, opt, atol=2e-2, rtol=1.6e-2)


class MasterAdamW(torch.optim.Optimizer):
    """bf16 parameters with fp32 master weights and fp32 moments (mixed-precision training)."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].update(master=p.detach().float().clone(), m=torch.zeros_like(p, dtype=torch.float32),
                                     v=torch.zeros_like(p, dtype=torch.float32))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                s = self.state[p]
                g = p.grad.float()
                s["m"].lerp_(g, 1 - b1)
                s["v"].mul_(b2).addcmul_(g, g, value=1 - b2)
                s["master"].mul_(1 - group["lr"] * group["weight_decay"])
                s["master"].addcdiv_(s["m"], s["v"].sqrt().add_(group["eps"]), value=-group["lr"])
                p.copy_(s["master"])


def test_bf16_params_with_fp32_master_weights():
    ps = _params([(24, 5), (13,)], dtype=torch.bfloat16)
    ref, ours, ref_opt, opt, be = _run(MasterAdamW, ps)
    _assert_state_equal(ref_opt, opt, **FP32)  # the fp32 master weights and moments
    for r, o in zip(ref, ours):  # the bf16 copies of the fp32 masters (equal to 1e-5: may round 1 ulp apart)
        torch.testing.assert_close(o, r, atol=1e-2, rtol=8e-3)
    assert "optimizer_adam" in _applied(be)


def test_tensor_lr_schedule_does_not_recompile():
    lr = torch.tensor(0.01)

    def make(params):
        return torch.optim.AdamW(params, lr=lr.clone(), foreach=False)

    ref, ours, ref_opt, opt, be = _run(make, _params(), scheduler=True)
    for r, o in zip(ref, ours):
        torch.testing.assert_close(o, r, **FP32)
    assert be.graphs == 1, f"{be.graphs} graphs for 5 steps with 5 learning rates"


def test_float_lr_schedule_compiles_at_most_twice():
    """A float lr is specialized at the first compile; Dynamo makes it an input at the second (it
    reads it with .item(), which this backend keeps a tensor): no compile per step after that."""
    ref, ours, ref_opt, opt, be = _run(lambda p: torch.optim.AdamW(p, lr=0.01, foreach=True), _params(),
                                       scheduler=True)
    for r, o in zip(ref, ours):
        torch.testing.assert_close(o, r, **FP32)
    assert be.graphs <= 2
    assert all(d.verdict == "applied" for d in be.log.decisions)


def _clip_then_step(opt, params):
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()


_RAW_STEP = inspect.unwrap(torch.optim.AdamW.step)  # without torch.optim's graph break at entry


def _clip_and_step_one_graph(opt, params):
    with torch.no_grad():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        _RAW_STEP(opt)


@pytest.mark.parametrize("foreach", [False, True], ids=["for_loop", "foreach"])
@pytest.mark.parametrize("one_graph", [False, True], ids=["torch_optim_graphs", "one_graph"])
def test_clip_grad_norm_then_adamw_match_eager(one_graph, foreach):
    """torch.optim's step starts with a graph break: clip and step are two graphs (each fused); called
    without it (inspect.unwrap) they are one graph and the clip coefficient joins the update."""
    step = _clip_and_step_one_graph if one_graph else _clip_then_step
    ref, ours, ref_opt, opt, be = _run(lambda p: torch.optim.AdamW(p, lr=0.01, foreach=foreach), _params(),
                                       step_fn=step, grad_scale=3.0)
    for r, o in zip(ref, ours):
        torch.testing.assert_close(o, r, **FP32)
        torch.testing.assert_close(o.grad, r.grad, **FP32)  # the clipped gradients, as eager leaves them
    _assert_state_equal(ref_opt, opt, **FP32)
    applied = _applied(be)
    assert "clip_grad_norm" in applied and "optimizer_adam" in applied, applied
    if one_graph:
        assert be.graphs == 1
    for gm in be.rewritten:  # the norms are stacked back as the op's output is, not copied again
        assert not [n for n in gm.graph.nodes if n.target is torch.ops.aten.stack.default and any(
            a.target is torch.ops.aten.select.int for a in n.args[0])]


def _clip_and_raw_step(opt, params):
    with torch.no_grad():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        inspect.unwrap(type(opt).step)(opt)


@pytest.mark.parametrize("one_graph", [False, True], ids=["two_graphs", "one_graph"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_clip_grad_norm_then_each_optimizer_match_eager(name, one_graph):
    make, pattern = OPTIMIZERS[name]
    step = _clip_and_raw_step if one_graph else _clip_then_step
    ref, ours, ref_opt, opt, be = _run(lambda ps: make(ps, True), _params(), step_fn=step, grad_scale=3.0)
    for r, o in zip(ref, ours):
        torch.testing.assert_close(o, r, **FP32)
        torch.testing.assert_close(o.grad, r.grad, **FP32)
    _assert_state_equal(ref_opt, opt, **FP32)
    assert {pattern, "clip_grad_norm"} <= set(_applied(be)), be.log.decisions


def test_skip_clipped_grad_store_keeps_unclipped_grads():
    ref, ours, ref_opt, opt, be = _run(lambda p: torch.optim.AdamW(p, lr=0.01, foreach=True), _params(),
                                       step_fn=_clip_and_step_one_graph, grad_scale=3.0, steps=1,
                                       config=dict(ALWAYS, skip_clipped_grad_store=True))
    for r, o in zip(ref, ours):
        torch.testing.assert_close(o, r, **FP32)  # the update used the clipped gradients
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(o.grad) for o in ours]))
    assert total > 1.5  # ... which were not written back (eager's are clipped to norm 1)


def _erf_step(opt, params):
    with torch.no_grad():
        for p in params:
            p.sub_(torch.erf(p.grad) * 0.1)
        opt.step()


def test_unsupported_op_leaves_its_lanes_to_the_handoff():
    ref, ours, ref_opt, opt, be = _run(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=False),
                                       _params([(8, 3), (5,)]), step_fn=_erf_step, steps=2)
    for r, o in zip(ref, ours):
        torch.testing.assert_close(o, r, **FP32)
    reasons = [d.reason for d in be.log.decisions if d.verdict == "rejected"]
    assert any("aten.erf" in r for r in reasons), be.log.decisions


def test_non_contiguous_parameter_is_rejected_with_reason():
    base = torch.randn(6, 8)
    ps = [torch.nn.Parameter(base.t()), torch.nn.Parameter(torch.randn(5))]  # a transposed leaf
    ref, ours, ref_opt, opt, be = _run(lambda p: torch.optim.AdamW(p, lr=0.01, foreach=False), ps,
                                       steps=2)
    for r, o in zip(ref, ours):
        torch.testing.assert_close(o, r, **FP32)
    rows = {(d.verdict, d.inputs[0]): d.reason for d in be.log.decisions}
    assert rows[("rejected", "f32[8, 6]")].startswith("non-contiguous tensor f32[8, 6] (strides [1, 8])")
    assert ("applied", "f32[5]") in rows


def test_cpu_without_interpreter_is_rejected(monkeypatch):
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    ref, ours, ref_opt, opt, be = _run(lambda p: torch.optim.AdamW(p, lr=0.01, foreach=True),
                                       _params([(4, 4)]), steps=1)
    torch.testing.assert_close(ours[0], ref[0], **FP32)
    assert not _applied(be)
    assert any("Triton kernels need CUDA" in d.reason for d in be.log.decisions)


def test_disabled_family_keeps_the_step_unfused():
    ref, ours, ref_opt, opt, be = _run(lambda p: torch.optim.AdamW(p, lr=0.01, foreach=True),
                                       _params([(4, 4)]), steps=1,
                                       config=dict(ALWAYS, disable_families="optimizer"))
    torch.testing.assert_close(ours[0], ref[0], **FP32)
    assert not _applied(be)


def test_adamw_through_inductor():
    ref, ours, ref_opt, opt, be = _run(lambda p: torch.optim.AdamW(p, lr=0.01, foreach=True),
                                       _params([(33, 17), (7,), (0,)]), steps=3,
                                       config=dict(handoff="inductor", cost_model="always"))
    for r, o in zip(ref, ours):
        torch.testing.assert_close(o, r, **FP32)
    _assert_state_equal(ref_opt, opt, **FP32)
    assert "optimizer_adam" in _applied(be)


def test_kernel_that_fails_to_compile_leaves_the_step_to_the_handoff(monkeypatch):
    original = multi_tensor.source

    def broken(program):
        return original(program).replace("tl.load(BLOCK_LANE", "tl.lod(BLOCK_LANE")

    monkeypatch.setattr(multi_tensor, "_KERNELS", {})
    monkeypatch.setattr(multi_tensor, "source", broken)
    ref, ours, ref_opt, opt, be = _run(lambda p: torch.optim.AdamW(p, lr=0.01, foreach=True),
                                       _params([(4, 4), (3,)]), steps=2)
    for r, o in zip(ref, ours):
        torch.testing.assert_close(o, r, **FP32)
    assert not _applied(be)
    assert any("generated kernel failed to compile or run" in d.reason for d in be.log.decisions)


def test_state_dict_round_trip_continues_like_eager():
    """state_dict() after 3 steps equals eager's; loading it into fresh optimizers (new state
    tensors) and stepping on matches eager too."""
    make = lambda p: torch.optim.AdamW(p, lr=0.01, foreach=True)  # noqa: E731
    ref, ours, ref_opt, opt, be = _run(make, _params([(6, 5), (4,)]), steps=3)
    _assert_state_equal(ref_opt, opt, **FP32)
    ref_opt2, opt2 = make(ref), make(ours)
    ref_opt2.load_state_dict(ref_opt.state_dict())
    opt2.load_state_dict(opt.state_dict())
    compiled = torch.compile(opt2.step, backend=fc.backend(**ALWAYS))
    for _ in range(2):
        grads = _grads(ref)
        _set_grads(ref, grads)
        _set_grads(ours, grads)
        ref_opt2.step()
        compiled()
    for r, o in zip(ref, ours):
        torch.testing.assert_close(o, r, **FP32)
    _assert_state_equal(ref_opt2, opt2, **FP32)


@pytest.mark.parametrize("foreach,verdict", [(True, "rejected"), (False, "applied")],
                         ids=["foreach_keeps_inductor", "for_loop_fused"])
def test_roofline_against_inductor_follows_the_h200_measurements(foreach, verdict):
    """Inductor's kernels on the foreach graph reach 4.21 TB/s, ours 4.13, its per-tensor kernels
    3.95 (H200): the cost model keeps Inductor on the foreach spelling (do no harm) and takes the
    for-loop spelling."""
    config = dict(handoff="aot_eager", cost_baseline="inductor", device_profile="h200")
    ref, ours, ref_opt, opt, be = _run(lambda p: torch.optim.AdamW(p, lr=0.01, foreach=foreach),
                                       _params([(64, 48), (31,)]), steps=1, config=config)
    rows = [d for d in be.log.decisions if d.pattern == "optimizer_adam"]
    assert [d.verdict for d in rows] == [verdict], rows
    assert ("foreach spelling" if foreach else "for-loop spelling") in rows[0].reason
    assert not [d for d in be.log.decisions if d.verdict == "fallback"]  # an unfused step: no noise
    for r, o in zip(ref, ours):
        torch.testing.assert_close(o, r, **FP32)


def test_estimates_at_the_benchmark_size():
    """468.7M fp32 parameters in 42 tensors (benchmarks/bench_optimizer.py): AdamW moves 28 B/param;
    with the clip's gradients not stored, 32 B against Inductor's 36: taken even on foreach graphs."""
    from fusion_compiler import cost
    ctx = cost.CostContext(cost.PROFILES["h200"], "inductor", False)
    n = 468_713_472
    adamw = n * 28
    assert not cost.estimate_multi_tensor(adamw, adamw, 0, 0, 42, True, ctx).profitable
    assert cost.estimate_multi_tensor(adamw, adamw, 0, 0, 42, False, ctx).profitable
    assert cost.estimate_multi_tensor(n * 32, n * 36, 0, 0, 42, True, ctx).profitable
    # clip + AdamW with eager's clipped-gradient store (36 B each): the clip's norm pass (4 B) decides it
    # (H200: ours 4.10 ms, Inductor 4.26)
    assert not cost.estimate_multi_tensor(n * 32, n * 32, 0, 0, 42, True, ctx).profitable
    assert cost.estimate_multi_tensor(n * 32, n * 32, 0, 0, 42, True, ctx, norm_bytes=n * 4).profitable


def test_fused_optimizer_kernel_is_named_not_followed():
    """An update written by an op on lists (torch._fused_adamw_) is reported, not misread as no update."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fusion_compiler import state_update

    def step(p, g, m, v, s):
        torch._fused_adamw_([p], [g], [m], [v], [], [s], lr=0.01, beta1=0.9, beta2=0.999, weight_decay=0.01,
                            eps=1e-8, amsgrad=False, maximize=False)

    with torch.no_grad():
        gm = make_fx(step)(torch.randn(4, 3), torch.randn(4, 3), torch.zeros(4, 3), torch.zeros(4, 3),
                           torch.tensor(1.0))
    vals = state_update.values_of(gm)
    assert vals.opaque_writes == ["aten._fused_adamw_"]
    assert state_update.lanes(vals) == []


def test_inference_graph_writing_an_input_gets_no_optimizer_rows():
    """A KV-cache write under no_grad is an in-place update too, but not an elementwise one: no
    optimizer row, and the graph's own regions are still fused."""
    def f(cache, x, idx, w):
        with torch.no_grad():
            cache.index_copy_(0, idx, x)
            return torch.nn.functional.rms_norm(cache * w, (8,), w)

    cache, x, idx, w = torch.zeros(6, 8), torch.randn(2, 8), torch.tensor([1, 4]), torch.randn(8)
    be = fc.backend(**ALWAYS)
    out = torch.compile(f, backend=be)(cache.clone(), x, idx, w)
    torch.testing.assert_close(out, f(cache.clone(), x, idx, w), **FP32)
    assert [(d.pattern, d.verdict) for d in be.log.decisions] == [("rms_norm", "applied")]


def test_functional_update_of_inputs_is_fused():
    """An update written as a function of its tensors (no optimizer object): lanes of the inputs."""
    def sgd(params, grads, bufs, lr):
        with torch.no_grad():
            for p, g, b in zip(params, grads, bufs):
                b.mul_(0.9).add_(g)
                p.add_(b, alpha=-lr)

    params, grads, bufs = _grads(_params([(9, 4), (5,)])), _grads(_params([(9, 4), (5,)])), \
        _grads(_params([(9, 4), (5,)]))
    ref = [[t.clone() for t in ts] for ts in (params, grads, bufs)]
    be = fc.backend(**ALWAYS)
    torch.compile(sgd, backend=be)(params, grads, bufs, 0.1)
    sgd(*ref, 0.1)
    for a, b in zip(params + bufs, ref[0] + ref[2]):
        torch.testing.assert_close(a, b, **FP32)
    assert _applied(be) == ["optimizer_sgd_momentum"], be.log.decisions


def test_first_sgd_momentum_step_is_a_near_miss():
    """SGD creates its momentum buffers inside the first step and that graph returns them: the update
    is read before it ends, so it stays unfused (near-miss, with the reason); later steps are fused."""
    ref, ours, ref_opt, opt, be = _run(lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=False),
                                       _params([(6, 5), (4,)]), steps=2)
    for r, o in zip(ref, ours):
        torch.testing.assert_close(o, r, **FP32)
    rows = [(d.graph, d.verdict, d.reason) for d in be.log.decisions if d.family == "optimizer"]
    assert rows[0][:2] == (0, "near-miss") and "graph's output reads a value of the update" in rows[0][2], rows
    assert (1, "applied") in [r[:2] for r in rows]
    ops = [n.target for n in be.rewritten[-1].graph.nodes if n.op == "call_function"]
    assert torch.ops.fusion.multi_tensor_apply.default in ops
