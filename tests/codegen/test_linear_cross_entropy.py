"""The chunked linear + cross-entropy against eager in float64: loss and the gradients of h, W, b."""
import pytest
import torch
import torch.nn.functional as F

from fusion_compiler.codegen.linear_cross_entropy import chunk_rows, linear_cross_entropy
from tests.helpers import assert_close


def _eager(h, w, b, t, reduction, cap, smoothing=0.0):
    logits = F.linear(h, w, b)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return F.cross_entropy(logits, t, ignore_index=-100, reduction=reduction, label_smoothing=smoothing)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("cap", [0.0, 3.0])
def test_matches_eager_over_several_chunks(dtype, reduction, bias, cap):
    n, hdim, v = 203, 48, 1031  # 203 rows in chunks of 64: three full chunks and a short one
    h = torch.randn(n, hdim).to(dtype)
    w = (torch.randn(v, hdim) / hdim ** 0.5).to(dtype)
    b = torch.randn(v).to(dtype) if bias else None
    t = torch.randint(0, v, (n,))
    t[[0, 77, 202]] = -100
    budget = 64 * v * h.element_size()
    loss, dh, dw, db = linear_cross_entropy(h, w, b, t, -100, reduction, 0.0, cap, True, budget=budget)
    leaves = [x.double().requires_grad_() for x in (h, w) + ((b,) if bias else ())]
    ref = _eager(leaves[0], leaves[1], leaves[2] if bias else None, t, reduction, cap)
    grads = torch.autograd.grad(ref, leaves)
    assert_close(loss, ref, dtype, "loss")  # the logits are rounded to dtype, as eager's are
    assert dh.dtype == dw.dtype == dtype
    # the gradients go through bf16 logits gradients (as eager's own bf16 backward does)
    assert_close(dh, grads[0], dtype, "dh", factor=2)
    assert_close(dw, grads[1], dtype, "dw", factor=2)
    if bias:
        assert_close(db, grads[2], dtype, "db", factor=2)
    else:
        assert db is None


def test_without_grad_computes_only_the_loss():
    h, w, t = torch.randn(10, 8), torch.randn(30, 8), torch.randint(0, 30, (10,))
    loss, dh, dw, db = linear_cross_entropy(h, w, None, t, -100, "mean", 0.0, 0.0, False)
    assert dh is None and dw is None and db is None
    assert_close(loss, _eager(h.double(), w.double(), None, t, "mean", 0.0), torch.float32, "loss")


def test_all_ignored_batch_gives_zero_loss_and_gradients():
    h, w = torch.randn(10, 8), torch.randn(30, 8)
    loss, dh, dw, _ = linear_cross_entropy(h, w, None, torch.full((10,), -100), -100, "mean", 0.0, 0.0, True)
    assert loss.item() == 0.0 and (dh == 0).all() and (dw == 0).all()


def test_chunk_rows_follow_the_budget():
    cpu = torch.device("cpu")
    assert chunk_rows(4096, 128256, 2, cpu) == 1024  # 256 MiB of bf16 logits
    assert chunk_rows(100, 128256, 2, cpu) == 100
    assert chunk_rows(4096, 128256, 2, cpu, budget=1) == 64  # never fewer rows than a GEMM needs
