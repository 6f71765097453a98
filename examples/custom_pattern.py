"""A user-written pattern: QuickGELU (x * sigmoid(1.702 x), CLIP / OpenAI GPT-2 style) becomes one op.

The user writes the op (here a torch.library custom op with its own backward: any implementation
works, e.g. a Triton kernel), then declares the pattern in plain PyTorch. Run:
    TRITON_INTERPRET=1 python examples/custom_pattern.py
"""
import dataclasses

import torch
import torch.nn as nn

import fusion_compiler as fc
from fusion_compiler.cost import estimate_fused


# --- the user's op -------------------------------------------------------------------------------------
@torch.library.custom_op("my_ops::quick_gelu", mutates_args=())
def quick_gelu(x: torch.Tensor, alpha: float) -> torch.Tensor:
    return x * torch.sigmoid(alpha * x)


@quick_gelu.register_fake
def _(x, alpha):
    return torch.empty_like(x)


def _backward(ctx, dy):
    (x,) = ctx.saved_tensors
    s = torch.sigmoid(ctx.alpha * x)
    return dy * (s + ctx.alpha * x * s * (1 - s)), None


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.alpha = inputs[1]


quick_gelu.register_autograd(_backward, setup_context=_setup)


# --- the pattern: search in plain PyTorch, replacement calls the op ------------------------------------
def _only_floats(match):
    (x, _alpha) = match.input_values()
    return None if x.is_floating_point() else f"dtype {x.dtype}"


@fc.register_pattern(
    name="quick_gelu", family="custom",
    replacement=lambda x, alpha: torch.ops.my_ops.quick_gelu(x, alpha),
    example_inputs=[torch.randn(8, 16), 1.7021],  # the float is a scalar wildcard: binds 1.702 below
    can_apply=_only_floats,
    # my op is one kernel where the graph had three separate ones: price it against the unfused ops
    should_apply=lambda match, ctx: estimate_fused(match, dataclasses.replace(ctx, baseline="eager")),
)
def quick_gelu_search(x, alpha):
    return x * torch.sigmoid(alpha * x)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(h * torch.sigmoid(1.702 * h))


def main():
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 9, 32)
    report = fc.explain(model, x)
    print(report)
    [d] = report.where(pattern="quick_gelu")
    assert d.verdict == "applied" and d.inputs[-1] == "1.702", d

    backend = fc.backend(handoff="aot_eager")
    out = torch.compile(model, backend=backend)(x)
    ref = model(x)
    torch.testing.assert_close(out, ref)
    g = torch.autograd.grad(out.sum(), model.fc1.weight)[0]
    torch.testing.assert_close(g, torch.autograd.grad(ref.sum(), model.fc1.weight)[0])
    ops = [str(n.target) for gm in backend.rewritten for n in gm.graph.nodes if n.op == "call_function"]
    assert "my_ops.quick_gelu.default" in ops
    print("quick_gelu applied; forward and gradients match eager")


if __name__ == "__main__":
    main()
