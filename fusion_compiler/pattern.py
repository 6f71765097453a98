"""The public pattern API. The library's own patterns are declared with it too.

    @fusion_compiler.register_pattern(
        name="scaled_tanh", family="custom",
        replacement=lambda x, scale: my_ops.scaled_tanh(x, scale),
        example_inputs=[torch.randn(8, 16), 0.5],
    )
    def scaled_tanh(x, scale):
        return torch.tanh(x) * scale

A search function is plain PyTorch over its example inputs: tensors become wildcards that bind to any
node of the user's graph; Python floats and ints are scalar wildcards (pick a distinctive example
value: every literal of that type equal to it in the traced search function binds to that argument). The search function may
return one tensor or a tuple; the replacement takes the same arguments and returns the same structure.
Outputs after the first must be computed on the way to the first (e.g. (norm(x + r), x + r)).

can_apply(match) -> None | str      legality: None, or the reason the region must not be rewritten
should_apply(match, ctx) -> Estimate profitability: cost.estimate_fused by default
fp8_producer=True                   the replacement's first output comes from a fusion op that can also
                                    write it in FP8 by rows (an `_fp8` twin in patterns/fp8.py: the
                                    library's norms and GLUs); with an FP8 recipe the cost model credits
                                    the region with the casts it saves the FP8 linears reading it
"""
import dataclasses
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from .canonical import trace_function

_REGISTRY: dict[str, "Pattern"] = {}


@dataclasses.dataclass
class Pattern:
    name: str
    family: str
    search: Callable
    replacement: Callable
    example_inputs: tuple
    can_apply: Optional[Callable[[Any], Optional[str]]] = None
    should_apply: Optional[Callable[[Any, Any], Any]] = None
    priority: int = 0  # larger runs first (a region matched by a larger pattern is not re-matched)
    kernel: str = ""  # cost-model key (e.g. "rms_norm"); defaults to the name
    fp8_producer: bool = False  # output 0 can be written in FP8 too (patterns/fp8.py's twins)
    _graph: Optional[fx.GraphModule] = dataclasses.field(default=None, repr=False)
    _exact: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def scalar_names(self) -> dict[int, float]:
        """Positions and example values of the scalar (Python float or int) arguments."""
        return scalars(self.example_inputs)

    def graph(self) -> fx.GraphModule:
        """The search function traced and canonicalized at its example inputs (cached)."""
        if self._graph is None:
            self._graph = trace_function(self.search, list(self.example_inputs))
        return self._graph

    def graph_at(self, inputs: list) -> fx.GraphModule:
        """The search function re-traced at the inputs of a candidate match, for exact verification."""
        key = tuple((tuple(t.shape), tuple(t.stride()), t.dtype, t.device.type) if isinstance(t, torch.Tensor)
                    else t for t in inputs)
        if key not in self._exact:
            self._exact[key] = trace_function(self.search, inputs)
        return self._exact[key]


def scalars(values) -> dict:
    """{position: value} of the Python float and int (not bool) entries of `values`."""
    return {i: v for i, v in enumerate(values) if isinstance(v, (int, float)) and not isinstance(v, bool)}


def register_pattern(name: str, *, replacement: Callable, example_inputs, family: str = "custom",
                     can_apply=None, should_apply=None, priority: int = 0, kernel: str = "",
                     search: Optional[Callable] = None, fp8_producer: bool = False):
    """Register a pattern (returns the search function, so it works as a decorator or a call)."""
    def add(fn):
        if name in _REGISTRY:
            raise ValueError(f"pattern {name!r} is already registered")
        if not any(isinstance(t, torch.Tensor) for t in example_inputs):
            raise ValueError(f"pattern {name!r}: example_inputs need at least one tensor")
        _REGISTRY[name] = Pattern(name, family, fn, replacement, tuple(example_inputs), can_apply,
                                  should_apply, priority, kernel or name, fp8_producer)
        return fn
    return add(search) if search is not None else add


def unregister_pattern(name: str) -> None:
    _REGISTRY.pop(name)


def registered_patterns() -> list[Pattern]:
    """All patterns, library and user, largest priority first."""
    from . import library  # noqa: F401  (the library registers its patterns on first use)
    return sorted(_REGISTRY.values(), key=lambda p: -p.priority)
