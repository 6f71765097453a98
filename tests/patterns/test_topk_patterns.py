"""The router's top-k (patterns/topk.py, codegen/topk.py) against torch.topk: the values exactly (a
selection moves no bits), the indices where values are distinct, and the values' gradient."""
import dataclasses

import pytest
import torch

import fusion_compiler as fc
from fusion_compiler import cost
from fusion_compiler.codegen import topk as kernels
from tests.helpers import check_rewrite

ALWAYS = fc.FusionConfig(handoff="aot_eager", cost_model="always")


def _same_selection(x, values, indices, k):
    ref_values, _ = torch.topk(x, k, -1)
    assert values.dtype == x.dtype and indices.dtype == torch.int64
    assert torch.equal(values, ref_values)
    assert torch.equal(x.gather(-1, indices), values)  # each index holds its value
    assert all(len(set(row)) == k for row in indices.reshape(-1, k).tolist())  # no index twice


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,k", [((37, 8), 2), ((3, 13, 60), 6), ((19, 128), 8), ((5, 256), 1), ((4, 33), 33)])
def test_topk_rows_match_torch(dtype, shape, k):
    x = torch.randn(shape).to(dtype)
    values, indices = kernels.topk_rows(x, k)
    _same_selection(x, values, indices, k)
    if dtype == torch.float32:  # distinct values: the same order as torch's
        assert torch.equal(indices, torch.topk(x, k, -1).indices)


def test_nan_and_infinities_rank_as_in_torch_and_ties_take_the_lowest_index():
    full = torch.randn(6, 40)
    full[0, 8], full[0, 2] = float("nan"), float("inf")  # NaN first, then +inf
    full[1] = float("-inf")  # nothing but -inf: the lowest indices
    full[2, [4, 10, 30]] = 50.0  # a three-way tie at the top
    x = full[:, ::2]  # rows with a non-unit stride: the columns above are 4, 1; 2, 5, 15
    values, indices = kernels.topk_rows(x, 4)
    ref = torch.topk(x, 4, -1).values
    assert torch.equal(values.nan_to_num(), ref.nan_to_num()) and values[0, 0].isnan()
    assert indices[0, :2].tolist() == [4, 1]
    assert indices[1].tolist() == [0, 1, 2, 3]
    assert indices[2, :3].tolist() == [2, 5, 15]


def _router(logits, k=2):
    """Softmax, top-k, and (k > 1: with k = 1 the weight would be 1) the renormalisation."""
    probs = torch.softmax(logits.float(), -1)
    top, index = torch.topk(probs, k, dim=-1)
    return (top / top.sum(-1, keepdim=True) if k > 1 else top).to(logits.dtype), index


@pytest.mark.parametrize("k", [1, 2, 8])
def test_router_rewrite_matches_eager_forward_and_gradient(k):
    """A Mixtral router (softmax, top-k, renormalisation) on 21 tokens of 16 experts."""
    def fn(h, w):
        weights, index = _router(h @ w.t(), k)
        return weights * (index.float() + 1)  # the indices reach the output: a wrong pick shows

    check_rewrite(fn, [torch.randn(21, 24), torch.randn(16, 24)], {"moe_router_topk": 1}, config=ALWAYS)


def _decisions(fn, *args, **config):
    be = fc.backend(handoff="aot_eager", **config)
    torch.compile(fn, backend=be)(*args)
    return [d for d in be.log.decisions if d.pattern == "moe_router_topk"]


def test_rows_too_wide_or_k_too_large_stay_with_torch():
    [wide] = _decisions(lambda x: torch.topk(x, 2, dim=-1)[0] * 2, torch.randn(3, kernels.MAX_WIDTH + 1),
                        cost_model="always")
    assert wide.verdict == "rejected" and f"> {kernels.MAX_WIDTH}" in wide.reason
    [many] = _decisions(lambda x: torch.topk(x, kernels.MAX_K + 1, dim=-1)[0] * 2, torch.randn(3, 100),
                        cost_model="always")
    assert many.verdict == "rejected" and "outside 1 .." in many.reason
    assert _decisions(lambda x: torch.topk(x, 2, dim=0)[0] * 2, torch.randn(5, 8), cost_model="always") == []
    [ints] = _decisions(lambda x: torch.topk(x, 2, dim=-1)[0] * 2, torch.randint(0, 9, (5, 8)), cost_model="always")
    assert ints.verdict == "rejected" and "not supported" in ints.reason


def test_cost_counts_the_ops_host_time_unless_the_step_is_replayed():
    """H100 figures (fake tensors), GPU time est. ours against torch.topk's, host time 50 us an op call.
    16384 tokens over 60 experts, top-4: 13 against 85 us; taken in inference launched op by op, declined
    in training (the backward's host time too), taken where the step is replayed as CUDA graphs.
    8192 tokens over 8 experts, top-2: 6 against 30 us, taken only where replayed. 16384 tokens over 128
    experts, top-8: 26 against 130 us, taken even in training op by op (126 with the host time)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        qwen, small, fine = (torch.empty(t, e, device="cuda") for t, e in ((16384, 60), (8192, 8), (16384, 128)))

    def estimate(scores, k, training, replayed, profile=cost.PROFILES["h100"]):
        return cost.estimate_topk(scores, k, cost.CostContext(profile, "inductor", training, replayed=replayed))

    assert estimate(qwen, 4, False, False).profitable
    assert not estimate(qwen, 4, True, False).profitable and "2 op call(s)" in estimate(qwen, 4, True, False).reason()
    assert estimate(qwen, 4, True, True).profitable
    assert not estimate(small, 2, False, False).profitable
    assert estimate(small, 2, True, True).profitable
    assert estimate(fine, 8, True, False).profitable
    unmeasured = dataclasses.replace(cost.PROFILES["h100"], topk=())
    assert not estimate(fine, 8, True, True, unmeasured).profitable
