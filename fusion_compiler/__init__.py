"""fusion_compiler: a torch.compile backend that rewrites LLM training graphs into fused kernels.

    torch.compile(model, backend="fusion")
    fusion_compiler.compile(model, fusion_compiler.backend(config))   # with the backend's Dynamo settings
    fusion_compiler.explain(model, *example_inputs)
    @fusion_compiler.register_pattern(...)
"""
from .backend import FusionBackend, backend, compile  # noqa: A004  (torch.compile's counterpart)
from .config import FusionConfig
from .cost import Estimate
from .decisions import Decision
from .explain import Report, explain, last_report
from .matcher import Match
from .pattern import Pattern, register_pattern, registered_patterns, unregister_pattern

__all__ = [
    "Decision", "Estimate", "FusionBackend", "FusionConfig", "Match", "Pattern", "Report", "backend", "compile",
    "explain", "last_report", "register_pattern", "registered_patterns", "unregister_pattern",
]
VERSION = "0.1.0"
