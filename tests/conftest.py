import os
import tempfile

# Before triton is imported anywhere: run kernels through Triton's CPU interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "fusion-compiler-inductor"))

import pytest  # noqa: E402
import torch  # noqa: E402

from fusion_compiler.codegen import launch  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch, request):
    """Poisoned kernel outputs, a per-test seed, and no compiled code carried between tests."""
    monkeypatch.setattr(launch, "POISON", True)
    torch.manual_seed(hash(request.node.nodeid) % 2**31)
    torch.compiler.reset()
    yield
    torch.compiler.reset()
