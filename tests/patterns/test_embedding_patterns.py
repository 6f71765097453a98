import pytest
import torch
import torch.nn.functional as F

import fusion_compiler as fc
from tests.helpers import check_rewrite, placeholder_with

ALWAYS = fc.FusionConfig(handoff="aot_eager", cost_model="always")


@pytest.mark.parametrize("padding_idx", [None, 3])
def test_embedding_forward_and_table_gradient_match_eager(padding_idx):
    """Repeated ids (gradients of one row sum), a padding row (its gradient stays zero), odd sizes."""
    table = torch.randn(37, 19)
    ids = torch.randint(0, 37, (3, 11))
    ids[0, :4] = 5  # one row hit four times
    ids[1, 0] = 3

    def fn(weight, scale):
        return F.embedding(ids, weight, padding_idx=padding_idx) * scale

    check_rewrite(fn, [table, torch.randn(19)], {"embedding": 1}, config=ALWAYS)


def test_tied_table_gets_both_gradients():
    """Token embedding and LM head share the table: the two gradients add."""
    table = torch.randn(41, 16)
    ids = torch.randint(0, 41, (2, 9))

    def fn(weight, scale):
        h = F.embedding(ids, weight) * scale
        return torch.log_softmax(h @ weight.t(), -1)

    check_rewrite(fn, [table, torch.randn(16)], {"embedding": 1}, config=ALWAYS)


def _decisions(fn, *args, **config):
    be = fc.backend(handoff="aot_eager", **config)
    torch.compile(fn, backend=be)(*args)
    return be.log.decisions


def test_bf16_table_on_cpu_is_rejected_with_the_reason():
    table = torch.randn(20, 8, dtype=torch.bfloat16, requires_grad=True)
    [d] = _decisions(lambda w, ids: F.embedding(ids, w) * 2, table, torch.randint(0, 20, (6,)), cost_model="always")
    assert d.verdict == "rejected" and "accumulates in torch.bfloat16" in d.reason


def test_scale_grad_by_freq_keeps_its_aten_call():
    table = torch.randn(20, 8, requires_grad=True)
    ids = torch.randint(0, 20, (6,))
    decisions = _decisions(lambda w: F.embedding(ids, w, scale_grad_by_freq=True) * 2, table, cost_model="always")
    assert "applied" not in [d.verdict for d in decisions]


def test_cost_takes_the_llama_table_only_in_training_against_inductor():
    """128K x 2048 bf16 table, 4096 tokens (fake tensors): Inductor's backward would hold a 1 GiB fp32
    copy of the table; inference, an fp32 table and the eager baseline gain nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fusion_compiler import cost
    from fusion_compiler.matcher import Match
    from fusion_compiler.pattern import registered_patterns

    pattern = next(p for p in registered_patterns() if p.name == "embedding")
    graph = torch.fx.Graph()
    with FakeTensorMode():
        ids = torch.empty(2, 2048, dtype=torch.long, device="cuda")
        tables = {dt: torch.empty(128256, 2048, dtype=dt, device="cuda") for dt in (torch.bfloat16, torch.float32)}

    def estimate(dtype, training, baseline="inductor"):
        m = Match(pattern, None, [placeholder_with(graph, tables[dtype]), placeholder_with(graph, ids), -1], [], [])
        return cost.estimate_embedding(m, cost.CostContext(cost.PROFILES["h200"], baseline, training))

    train = estimate(torch.bfloat16, True)
    assert train.profitable and "0.98 GiB less peak memory" in train.reason()
    assert train.bytes_saved > 7 * 128256 * 2048  # 8VH of table traffic, less 4 bytes a token element
    for est in (estimate(torch.bfloat16, False), estimate(torch.float32, True), estimate(torch.bfloat16, True, "eager")):
        assert not est.profitable and est.bytes_saved == 0


def test_max_norm_renorms_the_table_in_place_before_the_lookup():
    """nn.Embedding(max_norm=...) renorms the looked-up rows of the table in place (through a
    detach) before the lookup: the rewritten lookup reads the renormed rows, and the table changes
    as in eager."""
    torch.manual_seed(0)
    ours, ref = torch.nn.Embedding(30, 8, max_norm=1.0), torch.nn.Embedding(30, 8, max_norm=1.0)
    ref.load_state_dict(ours.state_dict())
    ids = torch.randint(0, 30, (4, 5))
    scale = torch.randn(8)
    be = fc.FusionBackend(ALWAYS)
    out = torch.compile(lambda i: (ours(i) * scale).sum(), backend=be)(ids)
    out.backward()
    want = (ref(ids) * scale).sum()
    want.backward()
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(ours.weight, ref.weight)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad)
    assert [d.pattern for d in be.log.decisions if d.verdict == "applied"] == ["embedding"]
