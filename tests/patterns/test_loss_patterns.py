import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fusion_compiler as fc
from tests.helpers import check_rewrite


def _target(n=13, v=77):
    t = torch.randint(0, v, (n,))
    t[[0, 7]] = -100
    return t


SPELLINGS = {
    "cross_entropy_mean": lambda x, t: F.cross_entropy(x, t),
    "cross_entropy_sum": lambda x, t: nn.CrossEntropyLoss(reduction="sum")(x, t),
    "cross_entropy_none": lambda x, t: F.nll_loss(F.log_softmax(x, dim=-1), t, reduction="none"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(SPELLINGS))
def test_cross_entropy_spellings(name, dtype):
    check_rewrite(SPELLINGS[name], [torch.randn(13, 77).to(dtype), _target()], {name: 1}, dtype)


def test_hf_causal_lm_spelling_reads_the_logits_in_their_dtype():
    """HF: upcast to fp32, shift the labels, flatten: the fp32 copy is not materialized."""
    def lm_loss(logits, labels):
        logits = logits.float()
        labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    labels = torch.randint(0, 77, (2, 9))
    be = check_rewrite(lm_loss, [torch.randn(2, 9, 77).to(torch.bfloat16), labels], {"cross_entropy_mean": 1},
                       torch.bfloat16)
    assert be.log.decisions[0].inputs[0] == "bf16[18, 77]"


def test_log_softmax_used_elsewhere_is_a_near_miss():
    def fn(x, t):
        logp = F.log_softmax(x, dim=-1)
        return F.nll_loss(logp, t), logp.exp().amax()
    be = fc.backend(handoff="aot_eager", cost_model="always")
    torch.compile(fn, backend=be)(torch.randn(13, 77), _target())
    assert [d.verdict for d in be.log.decisions] == ["near-miss"]


def test_any_ignore_index_binds():
    t = torch.randint(0, 77, (13,))
    t[[1, 4]] = 3  # a pad token id as the ignored class
    be = check_rewrite(lambda x, t: F.cross_entropy(x, t, ignore_index=3), [torch.randn(13, 77), t],
                       {"cross_entropy_mean": 1})
    assert be.log.decisions[0].inputs[-1] == "3"


def test_float64_stays_eager():
    be = fc.backend(handoff="aot_eager", cost_model="always")
    torch.compile(SPELLINGS["cross_entropy_mean"], backend=be)(torch.randn(13, 77, dtype=torch.float64), _target())
    [d] = be.log.decisions
    assert d.verdict == "rejected" and "float64" in d.reason
