"""Every private PyTorch symbol we use lives in fusion_compiler._compat; fail loudly when one moves."""
import torch

from fusion_compiler import _compat


def test_every_private_symbol_resolves():
    for name in _compat.__all__:
        assert getattr(_compat, name) is not None, name
    assert callable(_compat.compile_fx) and callable(_compat.aot_eager) and callable(_compat.detect_fake_mode)
    assert torch.ops.aten._fused_rms_norm.default in _compat.CANONICAL_DECOMPOSITIONS


def test_size_hint_reads_a_symbolic_size_without_a_guard():
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    with _compat.FakeTensorMode(shape_env=env) as mode:
        x = mode.from_tensor(torch.empty(12, 5), symbolic_context=None)
    sym = env.create_unbacked_symint()
    assert _compat.size_hint(sym, fallback=77) == 77
    assert _compat.size_hint(7) == 7 and _compat.size_hint(x.shape[0]) == 12
    backed = env.create_symintnode(env.create_symbol(9, ConstantSource("n")), hint=9)
    assert _compat.size_hint(backed) == 9 and not env.guards


def test_supported_torch_version():
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    assert (major, minor) >= _compat.MIN_TORCH


def test_no_private_torch_import_outside_compat():
    import pathlib
    import re
    root = pathlib.Path(_compat.__file__).parent.parent
    private = re.compile(r"^\s*(from|import)\s+torch\.(\w+\.)*_\w+", re.M)
    offenders = []
    for path in list(root.glob("fusion_compiler/**/*.py")) + list(root.glob("patterns/*.py")) + \
            list(root.glob("codegen/*.py")):
        if path.name != "_compat.py" and private.search(path.read_text()):
            offenders.append(str(path.relative_to(root)))
    assert offenders == []


def test_recompute_policy_reaches_the_joint_graph_and_the_partitioner():
    import torch._functorch.partitioners as partitioners
    import torch.fx.proxy as proxy
    assert _compat.RECOMPUTE_META in proxy._COPY_META_FIELDS  # AOTAutograd copies it into the joint graph
    node = torch.fx.Graph().placeholder("x")
    node.meta[_compat.RECOMPUTE_META] = _compat.CheckpointPolicy.PREFER_RECOMPUTE
    assert partitioners.must_recompute(node)
    assert hasattr(torch._inductor.config, "joint_custom_pre_pass")  # recompute.JointCheck's hook


def test_dynamic_output_capture_setting_and_unbacked_sizes():
    """The Dynamo setting the backend enters (backend_ctx_ctor) exists and captures torch.where(mask)."""
    assert torch._dynamo.config.capture_dynamic_output_shape_ops is False  # the default, restored on exit
    with _compat.capture_dynamic_output_shapes():
        assert torch._dynamo.config.capture_dynamic_output_shape_ops is True
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    env = ShapeEnv()
    with _compat.FakeTensorMode(shape_env=env) as mode:
        rows = torch.nonzero(mode.from_tensor(torch.tensor([0, 1, 1])))
        static = mode.from_tensor(torch.empty(3, 2))
    assert _compat.has_unbacked(rows) and _compat.has_unbacked((static, rows)) and not _compat.has_unbacked(static)
