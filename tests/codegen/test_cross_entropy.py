import pytest
import torch
import torch.nn.functional as F

from fusion_compiler.codegen.cross_entropy import cross_entropy
from tests.helpers import DTYPES, assert_close


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("vocab", [1000, 5003])  # 5003: several blocks of the vocab per row
def test_loss_and_gradient(dtype, reduction, smoothing, vocab):
    x = (torch.randn(37, vocab) * 3).to(dtype)
    t = torch.randint(0, vocab, (37,))
    t[[2, 5, 30]] = -100
    loss, dx = cross_entropy(x, t, -100, reduction, smoothing)
    x64 = x.double().requires_grad_()
    ref = F.cross_entropy(x64, t, ignore_index=-100, reduction=reduction, label_smoothing=smoothing)
    g = torch.randn_like(ref)
    (d64,) = torch.autograd.grad(ref, x64, g)
    assert dx.dtype == dtype
    assert_close(loss, ref, torch.float32, "loss")  # accumulated in fp32 whatever the logits' dtype
    assert_close(dx.double() * (g[:, None] if reduction == "none" else g), d64, dtype, "dlogits")
    assert (dx[[2, 5, 30]] == 0).all()


def test_all_ignored_batch_gives_zero_not_nan():
    loss, dx = cross_entropy(torch.randn(4, 50), torch.full((4,), -100), -100, "mean")
    assert loss.item() == 0.0 and (dx == 0).all()
