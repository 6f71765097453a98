"""The examples a user copies run as shipped (in a subprocess: they register patterns globally)."""
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run(script: str, *args: str) -> str:
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def test_custom_pattern_example():
    out = _run("custom_pattern.py")
    assert "quick_gelu applied; forward and gradients match eager" in out


def test_demo_trains_and_prints_decisions():
    out = _run("train_llama.py", "--steps", "2")
    # 13 regions of the model (and per layer q/k/v and gate/up as horizontal GEMMs), the AdamW step
    assert "18 candidates: 18 applied" in out
    assert "optimizer_adam             applied" in out
    # the reference layer, default config: a norm saves less GPU time than its op calls cost the host
    assert "add_rms_norm      rejected" in out and "host time of 2 op call(s)" in out
    assert "glu_silu          rejected" in out


def test_mixtral_example_fuses_every_layers_experts():
    out = _run("train_mixtral.py", "--steps", "1")  # one step: the interpreter's grouped GEMMs are slow
    assert "4 candidates: 4 applied" in out  # the small model's two MoE layers: experts and router top-k
    assert "impl grouped_mm; fused kernel" in out and "vs inductor" in out  # the reference block, default config
