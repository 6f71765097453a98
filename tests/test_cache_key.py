"""Our ops' sources in Inductor's cache keys (fusion_compiler/cache_key.py): the same code hits the FX
graph cache; changed op or kernel sources are another key; a configured pre-pass still runs."""
import torch

import fusion_compiler as fc
from fusion_compiler import _compat, cache_key


def _norm(x, w):
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, 1e-6) * 2


def test_the_key_follows_the_sources(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("x = 1\n")
    b.write_text("y = 2\n")
    key = cache_key.OpsKey(files=(str(a), str(b))).uuid()
    assert key == cache_key.OpsKey(files=(str(a), str(b))).uuid()
    cache_key.source_hash.cache_clear()
    b.write_text("y = 3\n")
    assert cache_key.OpsKey(files=(str(a), str(b))).uuid() != key
    default = cache_key.source_hash()
    assert default and default == cache_key.source_hash()  # ops/ and codegen/ of this package


class _Counting(_compat.CustomGraphPass):
    def __init__(self):
        self.runs = 0

    def __call__(self, graph):
        self.runs += 1

    def uuid(self):
        return "counting"


def test_a_rewritten_graph_hits_the_cache_and_a_configured_pre_pass_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x, w = torch.randn(6, 40), torch.randn(40)
    theirs = _Counting()
    compiled = []
    with _compat.inductor_config.patch(fx_graph_cache=True, post_grad_custom_pre_pass=theirs):
        for changed in (False, False, True):
            torch.compiler.reset()
            if changed:  # as if a kernel's source had changed: another key
                monkeypatch.setattr(cache_key, "source_hash", lambda files=None: "another")
            be = fc.backend(cost_model="always")
            torch.testing.assert_close(torch.compile(_norm, backend=be)(x, w), _norm(x, w))
            assert "fusion.rms_norm" in str([n.target for g in be.rewritten for n in g.graph.nodes])
            compiled.append(theirs.runs)
    # the pre-pass runs when Inductor compiles: first time, not on the hit, again under another key
    assert compiled == [1, 1, 2]


def test_a_configured_callable_pre_pass_is_left_as_it_is():
    """A plain function (Inductor compiles without its cache then) or a list: nothing to chain."""
    def theirs(graph):
        pass
    assert cache_key.pre_pass(theirs) is None and cache_key.pre_pass([theirs]) is None
    assert isinstance(cache_key.pre_pass(None), cache_key.OpsKey)
    assert cache_key.pre_pass(_Counting()).chained.uuid() == "counting"
