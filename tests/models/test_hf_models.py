"""Real HF models from small configs (random weights, no hub): 3 training steps under the fusion
backend match eager, and explain() shows every layer's RMSNorm, RoPE and SwiGLU regions.

Tolerances: fp32 model; our kernels reorder fp32 reductions, so per-op relative error is ~1e-6 and
after 2 layers, 3 SGD steps and the LM head the loss agrees to 1e-5 and every gradient to 1e-3
(relative Frobenius norm; the smallest gradients, of the first layer's norm weights, dominate).
"""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

import fusion_compiler as fc
from tests.helpers import fusion_ops, rel_err
from tests.patterns.test_fp8 import sqnr

LAYERS = 2
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=112, num_hidden_layers=LAYERS,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SMALL)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**SMALL, sliding_window=None)),
}


def _train(model, forward, ids, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, grads = [], []
    for _ in range(steps):
        loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


def train_both_and_compare(make_model, backend, vocab=256, compiler=torch.compile):
    """Train a copy compiled with `backend` and an eager copy 3 steps; losses and every gradient agree."""
    torch.manual_seed(0)
    ref = make_model()
    ours = make_model()
    ours.load_state_dict(ref.state_dict())
    ids = torch.randint(0, vocab, (2, 24))
    ref_losses, ref_grads = _train(ref, ref, ids)
    losses, grads = _train(ours, compiler(ours, backend=backend), ids)
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: loss {a} vs eager {b}"
    for step, (g, r) in enumerate(zip(grads, ref_grads)):
        assert g.keys() == r.keys()
        for n in r:
            assert rel_err(g[n], r[n]) <= 1e-3, f"step {step}: grad of {n}: {rel_err(g[n], r[n]):.2e}"


def _logits_near_miss(d) -> bool:
    """HF returns outputs.logits: the LM head + loss region is a near-miss that names the switch."""
    return d.pattern == "linear_cross_entropy_mean" and d.verdict == "near-miss" and "drop_logits=True" in d.reason


@pytest.mark.parametrize("drop_logits", [False, True])
@pytest.mark.parametrize("name", list(MODELS))
def test_trains_with_every_region_fused(name, drop_logits):
    be = fc.backend(handoff="aot_eager", cost_model="always", drop_logits=drop_logits)
    train_both_and_compare(MODELS[name], be)
    applied = {}
    for d in be.log.decisions:
        assert d.verdict == "applied" or (not drop_logits and _logits_near_miss(d)), d
        applied[d.pattern] = applied.get(d.pattern, 0) + d.verdict.count("applied")
    applied = {k: v for k, v in applied.items() if v}
    # the first input norm has no residual add before it; the rest (and the final norm) do; with
    # drop_logits the LM head and the loss are one chunked op (the logits come back empty)
    loss = "linear_cross_entropy_mean" if drop_logits else "cross_entropy_mean"
    # per layer, q/k/v and gate/up are two horizontal GEMMs
    assert applied == {"rms_norm": 1, "add_rms_norm": 2 * LAYERS, "rope_rotate_half": 2 * LAYERS,
                       "glu_silu": LAYERS, loss: 1, "embedding": 1, "gemm_horizontal": 2 * LAYERS}


@pytest.mark.parametrize("name", list(MODELS))
def test_explain_shows_every_layer(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 24))
    report = fc.explain(model, input_ids=ids, labels=ids, config=fc.FusionConfig(cost_model="always"))
    locations = {d.pattern: {d.location for d in report.where(pattern=d.pattern)} for d in report.decisions}
    assert len(report.where(pattern="rope_rotate_half", verdict="applied")) == 2 * LAYERS
    assert len(report.where(pattern="glu_silu", verdict="applied")) == LAYERS
    assert len(report.where(family="norm", verdict="applied")) == 2 * LAYERS + 1
    assert all(loc.startswith(f"modeling_{name}.py:") for p, locs in locations.items() for loc in locs
               if "cross_entropy" not in p)
    [near_miss, loss] = report.where(family="loss")
    assert _logits_near_miss(near_miss)
    assert loss.location.startswith("loss_utils.py:") and loss.verdict == "applied"


def test_llama_by_name_with_inductor_and_the_roofline():
    """backend="fusion" as a user writes it: Inductor hand-off, default cost model. At these tiny
    shapes every region is launch-bound and ties with Inductor, so each is rejected with that reason."""
    before = len(fc.last_report().decisions)
    train_both_and_compare(MODELS["llama"], "fusion")
    new = fc.last_report().decisions[before:]
    assert {d.pattern for d in new} >= {"add_rms_norm", "rope_rotate_half", "glu_silu"}
    for d in new:
        assert d.verdict == "applied" or (d.verdict == "rejected" and "keep inductor" in d.reason) \
            or _logits_near_miss(d), d


def test_bf16_llama_step_is_as_close_to_float64_as_eager_bf16():
    """bf16 training: what matters is the distance to the exact (float64) answer, compared with eager
    bf16's own distance. Ours may be up to 1.5x further (+1e-3): our kernels round at other points
    than eager's ops (measured, with the interpreter rounding like the GPU: worst parameter 1.2x,
    the first RMSNorm's weight, 7.4e-3 vs eager's 6.2e-3)."""
    torch.manual_seed(0)
    exact = LlamaForCausalLM(LlamaConfig(**SMALL, attn_implementation="eager")).double()
    eager, ours = (LlamaForCausalLM(LlamaConfig(**SMALL, attn_implementation="eager")).to(torch.bfloat16)
                   for _ in range(2))
    eager.load_state_dict(exact.state_dict())
    ours.load_state_dict(exact.state_dict())
    ids = torch.randint(0, SMALL["vocab_size"], (2, 24))
    be = fc.backend(handoff="aot_eager", cost_model="always")
    losses = []
    for model, fwd in ((exact, exact), (eager, eager), (ours, torch.compile(ours, backend=be))):
        loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[2] - losses[0]) <= 1.5 * abs(losses[1] - losses[0]) + 1e-3 * abs(losses[0])
    for (n, p), e, x in zip(ours.named_parameters(), eager.parameters(), exact.parameters()):
        assert rel_err(p.grad, x.grad) <= 1.5 * rel_err(e.grad, x.grad) + 1e-3, n
    # norms, RoPE, SwiGLU, attention (and its k/v unrepeated), loss, and per layer the q/k/v and gate/up
    # horizontal GEMMs
    assert fc.Report(be.log.decisions).summary()["applied"] == 14 + 3 * LAYERS


def test_llama_with_every_rewrite_inside_inductors_generated_code():
    """Inductor hand-off with the rewrites forced: our ops (norms, RoPE, SwiGLU, SDPA with k/v unrepeated,
    the chunked LM head + cross-entropy, q/k/v and gate/up as horizontal GEMMs) run from Inductor's generated
    code, forward and backward, and 3 steps match
    eager. (This caught a fake kernel whose layout depended on the incoming gradient's strides.)"""
    be = fc.backend(cost_model="always", drop_logits=True)
    train_both_and_compare(lambda: LlamaForCausalLM(LlamaConfig(**SMALL, attn_implementation="eager")), be)
    assert fc.Report(be.log.decisions).summary() == {"candidates": 21, "applied": 21, "rejected": 0,
                                                     "near-miss": 0, "fallback": 0}


def test_llama_fp8_casts_its_linears_inputs_where_they_are_made():
    """FP8 (rowwise, emulated) on a bf16 HF Llama: every decoder linear runs in FP8; the inputs of
    q/k/v and gate/up are cast by the norm kernels and the down projection's by the GLU kernel; only
    o_proj (its input is attention's output) casts its own. Loss and every gradient stay within the
    recipe's error of eager bf16 (SQNR >= 20 dB; measured: loss |diff| 1e-4 of 5.52, gradients 21.6-29.7 dB)."""
    torch.manual_seed(0)
    eager, ours = (LlamaForCausalLM(LlamaConfig(**SMALL)).to(torch.bfloat16) for _ in range(2))
    ours.load_state_dict(eager.state_dict())
    ids = torch.randint(0, SMALL["vocab_size"], (2, 24))
    be = fc.backend(handoff="aot_eager", cost_model="always", fp8="rowwise", fp8_emulate=True, drop_logits=True)
    losses = []
    for fwd in (eager, torch.compile(ours, backend=be)):
        loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    ops = fusion_ops(be)
    assert ops.count("fusion::fp8_linear") == 7 * LAYERS and ops.count("fusion::glu_fp8") == LAYERS
    assert ops.count("fusion::rms_norm_fp8") + ops.count("fusion::add_rms_norm_fp8") == 2 * LAYERS
    assert ops.count("fusion::fp8_quantize_rows") == 0
    notes = [d.reason for d in be.log.decisions if d.pattern == "fp8_linear" and d.verdict == "applied"]
    assert sum("cast to FP8 in fusion::glu_fp8" in n for n in notes) == LAYERS
    assert sum("the kernel producing it" in n for n in notes) == 6 * LAYERS
    assert abs(losses[1] - losses[0]) <= 1e-3 * losses[0]
    for (n, p), e in zip(ours.named_parameters(), eager.parameters()):
        assert sqnr(p.grad, e.grad) >= 20, n
