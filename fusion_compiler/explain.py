"""explain(): compile a model once and report every decision, applied or not.

Report.to_json() schema ("fusion_compiler.report/1"):
    {"schema": "fusion_compiler.report/1",
     "summary": {"candidates": int, "applied": int, "rejected": int, "near-miss": int, "fallback": int},
     "decisions": [{"graph": int, "pattern": str, "family": str, "verdict": str, "reason": str,
                    "location": str, "inputs": [str], "bytes_saved": int | null,
                    "time_saved_us": float | null, "kernel": str}, ...]}
Fields are only ever added within a schema version.
"""
import dataclasses
import json

import torch

from .backend import FusionBackend
from .config import FusionConfig
from .decisions import VERDICTS, Decision

SCHEMA = "fusion_compiler.report/1"


@dataclasses.dataclass
class Report:
    decisions: list[Decision]

    def where(self, **fields) -> list[Decision]:
        """Decisions whose fields equal the given values, e.g. report.where(verdict="applied")."""
        return [d for d in self.decisions if all(getattr(d, k) == v for k, v in fields.items())]

    def summary(self) -> dict:
        counts = {v: 0 for v in VERDICTS}
        for d in self.decisions:
            counts[d.verdict] += 1
        return {"candidates": sum(1 for d in self.decisions if d.verdict != "fallback"), **counts}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps({"schema": SCHEMA, "summary": self.summary(),
                           "decisions": [d.to_dict() for d in self.decisions]}, indent=indent)

    def __str__(self) -> str:
        head = ("graph", "pattern", "verdict", "location", "inputs", "saved", "reason")
        rows = []
        for d in self.decisions:
            saved = "" if d.time_saved_us is None else \
                f"{(d.bytes_saved or 0) / 2**20:.1f}MiB/{d.time_saved_us:.1f}us"
            rows.append((str(d.graph), d.pattern, d.verdict, d.location, " ".join(d.inputs), saved,
                         d.reason.splitlines()[0] if d.reason else ""))
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head) - 1)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in [head, *rows]]
        s = self.summary()
        lines.append(f"{s['candidates']} candidates: {s['applied']} applied, {s['rejected']} rejected, "
                     f"{s['near-miss']} near-miss; {s['fallback']} graph fallbacks")
        return "\n".join(lines)


def explain(model_or_fn, *args, config: FusionConfig | None = None, **kwargs) -> Report:
    """Compile model_or_fn with the fusion backend, run it once on the arguments, return the report.

    Decisions are those of `config` (its cost baseline included); the compiled graph runs through the
    eager hand-off, so explain is quick and leaves the model unchanged.
    """
    config = config if config is not None else FusionConfig()
    config = dataclasses.replace(config, handoff="eager", cost_baseline=config.baseline)
    backend = FusionBackend(config)
    torch.compile(model_or_fn, backend=backend)(*args, **kwargs)
    return Report(list(backend.log.decisions))


def last_report() -> Report:
    """The decisions of every graph compiled so far with backend="fusion" (the default backend)."""
    from .backend import DEFAULT
    return Report(list(DEFAULT.log.decisions))
