"""FastKernel (codegen/launch.py): the same results as Triton's own launch, one compiled kernel per
specialization. The GPU half runs where CUDA is and the interpreter is off:
    TRITON_INTERPRET=0 python -m pytest tests/codegen/test_launch.py
"""
import pytest
import torch
import triton
import triton.language as tl

from fusion_compiler import _compat
from fusion_compiler.codegen import launch, rmsnorm


@triton.jit
def _axpy(X, Y, OUT, n, alpha, BLOCK: tl.constexpr, NEGATE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    out = alpha * tl.load(X + offs, mask=mask).to(tl.float32) + tl.load(Y + offs, mask=mask).to(tl.float32)
    tl.store(OUT + offs, (-out if NEGATE else out).to(OUT.dtype.element_ty), mask=mask)


def test_fast_launch_leaves_interpreted_kernels_alone():
    if not launch.interpreting():
        pytest.skip("the interpreter is off")
    assert launch.fast_launch(_axpy) is _axpy
    assert not isinstance(rmsnorm._rms_norm_fwd_kernel, launch.FastKernel)


def test_triton_launch_internals_exist():
    """The Triton internals FastKernel calls (_compat): fail loudly when a supported Triton moves them."""
    if not _compat.TRITON_FAST_LAUNCH:
        pytest.skip(f"triton {triton.__version__}: FastKernel falls back to Triton's own launch")
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime.jit import JITFunction
    assert callable(JITFunction.create_binder) and isinstance(CompiledKernel.run, property)
    assert not _compat.triton_launch_hooked()
    triton.knobs.runtime.launch_enter_hook.add(print)
    try:
        assert _compat.triton_launch_hooked()
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(print)


@pytest.mark.skipif(not torch.cuda.is_available() or launch.interpreting(), reason="needs CUDA, interpreter off")
def test_fast_launch_matches_triton_across_specializations(monkeypatch):
    fast = []
    launch_compiled = _compat.triton_launch
    monkeypatch.setattr(_compat, "triton_launch", lambda *a: fast.append(1) or launch_compiled(*a))
    kernel = launch.fast_launch(triton.jit(_axpy.fn if hasattr(_axpy, "fn") else _axpy))
    assert isinstance(kernel, launch.FastKernel)
    base = torch.randn(4099, device="cuda", dtype=torch.bfloat16)
    other = torch.randn(4099, device="cuda", dtype=torch.float32)
    # aligned and misaligned pointers, n a multiple of 16 and not, two dtypes, a constexpr flipped:
    # each is its own specialization; repeats take the cached path
    cases = [(base[:4096], other[:4096], False), (base[1:4097], other[1:4097], False), (base[:4095], other[:4095], True),
             (other[:1000], other[3:1003], False)]
    for _ in range(3):
        for x, y, negate in cases:
            out = torch.empty_like(x)
            kernel[(triton.cdiv(x.numel(), 256),)](x, y, out, x.numel(), 0.5, BLOCK=256, NEGATE=negate)
            ref = 0.5 * x.float() + y.float()
            torch.testing.assert_close(out.float(), -ref if negate else ref, rtol=1e-2, atol=1e-2)
    assert len(kernel.compiled) == len(cases) and len(fast) == 2 * len(cases)  # Triton's path once each
