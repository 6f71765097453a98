"""The GEMM tuning cache: the fastest tile config per (device, epilogue, dtype, shape, strides), with
the times that chose it, kept as JSON on disk so a shape is timed once per machine.

    FUSION_TUNING_CACHE=/path/gemm_tuning.json   (default ~/.cache/fusion_compiler/gemm_tuning.json)
"""
import json
import os

_TABLE: dict | None = None
_VERSION = 0  # bumped on every record: cached launch plans of the old table are stale


def path() -> str:
    default = os.path.join(os.path.expanduser("~"), ".cache", "fusion_compiler", "gemm_tuning.json")
    return os.environ.get("FUSION_TUNING_CACHE", default)


def _table() -> dict:
    global _TABLE
    if _TABLE is None:
        try:
            with open(path()) as f:
                _TABLE = json.load(f)
        except (OSError, ValueError):  # no cache yet, or an unreadable one: start empty
            _TABLE = {}
    return _TABLE


def entry(key: str) -> dict | None:
    return _table().get(key)


def lookup(key: str) -> tuple | None:
    """The stored config for key, or None."""
    found = entry(key)
    return tuple(found["config"]) if found else None


def version() -> int:
    return _VERSION


def record(key: str, value: dict) -> None:
    global _VERSION
    _VERSION += 1
    table = _table()
    table[key] = value
    target = path()
    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    tmp = f"{target}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    os.replace(tmp, target)


def clear() -> None:
    """Forget the in-memory table (tests point FUSION_TUNING_CACHE elsewhere, then call this)."""
    global _TABLE, _VERSION
    _TABLE = None
    _VERSION += 1
