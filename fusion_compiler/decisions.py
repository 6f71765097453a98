"""The decision log: one Decision per candidate region, applied or not, with its reason."""
import dataclasses
import logging
import re
from typing import Optional

import torch
import torch.fx as fx

logger = logging.getLogger("fusion_compiler")

VERDICTS = ("applied", "rejected", "near-miss", "fallback")


@dataclasses.dataclass(frozen=True)
class Decision:
    """One row of the report; see README "Decision JSON" for the field meanings."""
    graph: int  # index of the compiled graph (Dynamo may hand over several)
    pattern: str  # pattern name, or "-" for a whole-graph fallback
    family: str
    verdict: str  # applied | rejected | near-miss | fallback
    reason: str
    location: str  # "file.py:123" in the user's code, or ""
    inputs: tuple  # "bf16[2, 16, 64]" per tensor input of the region
    bytes_saved: Optional[int] = None  # estimated, fwd (+bwd when training), vs the cost baseline
    time_saved_us: Optional[float] = None
    kernel: str = ""  # the op the region became (applied) or would have become

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"inputs": list(self.inputs)}


_DTYPE_SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
                torch.complex64: "c64", torch.int64: "i64", torch.int32: "i32", torch.bool: "bool"}


def describe(value) -> str:
    if isinstance(value, torch.Tensor):
        dt = _DTYPE_SHORT.get(value.dtype, str(value.dtype).replace("torch.", ""))
        return f"{dt}{list(value.shape)}"
    return repr(value)


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def location(node: Optional[fx.Node]) -> str:
    """file:line of the innermost user frame in the node's stack trace."""
    trace = node.meta.get("stack_trace") if node is not None else None
    if not trace:
        return ""
    frames = _FRAME.findall(trace)
    if not frames:
        return ""
    path, line = frames[-1]
    return f"{path.rsplit('/', 1)[-1]}:{line}"


class DecisionLog:
    """Collects decisions and mirrors each one to the `fusion_compiler` logger."""

    def __init__(self):
        self.decisions: list[Decision] = []

    def add(self, decision: Decision) -> None:
        self.decisions.append(decision)
        level = logging.WARNING if decision.verdict == "fallback" else logging.INFO
        if logger.isEnabledFor(level):
            logger.log(level, "%s %s at %s: %s", decision.verdict, decision.pattern,
                       decision.location or "?", decision.reason)
