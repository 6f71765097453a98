"""The pattern library: importing it registers every family's patterns (patterns/*.py)."""
from fusion_compiler.patterns import attention, elementwise, embedding, loss, norm  # noqa: F401
