"""Our ops' code in Inductor's cache keys.

A graph handed to Inductor holds fusion:: ops whose fake (meta) functions fix the output shapes and
strides that the compiled code asserts; the FX graph and AOTAutograd caches key the graph, not those
functions. After an upgrade of this package (same torch) a cached graph could replay the old ops'
layouts (an assertion at run time: seen on the H100 when two trees shared one cache). `OpsKey` is a
post-grad pre-pass that changes nothing in the graph; its uuid, which both caches take into their
keys, hashes the sources of the ops and their kernels, and chains a pre-pass already configured.
"""
import functools
import hashlib
import pathlib

from . import _compat

@functools.lru_cache(maxsize=None)
def source_hash(files: tuple[str, ...] | None = None) -> str:
    """The hash of the op and kernel sources (this package's ops/ and codegen/ modules)."""
    from . import codegen, ops
    if files is None:
        dirs = [pathlib.Path(ops.__file__).parent, pathlib.Path(codegen.__file__).parent]
        files = tuple(sorted(str(p) for d in dirs for p in d.glob("*.py")))
    digest = hashlib.sha256()
    for f in files:
        digest.update(pathlib.Path(f).read_bytes())
    return digest.hexdigest()


class OpsKey(_compat.CustomGraphPass):
    """A no-op pre-pass (running `chained`, the configured one, if any) keyed by `source_hash`."""

    def __init__(self, chained=None, files: tuple[str, ...] | None = None):
        self.chained, self.files = chained, files

    def __call__(self, graph) -> None:
        if self.chained is not None:
            self.chained(graph)

    def uuid(self):
        chained = None if self.chained is None else self.chained.uuid()
        return (source_hash(self.files), chained)


def pre_pass(configured):
    """The pre-pass to hand Inductor: OpsKey chaining `configured` (None or a CustomGraphPass), or None
    (leave the configured one as it is) for another kind (a plain callable or a list: Inductor does
    not cache graphs compiled with a plain callable, and has no key to chain)."""
    if configured is None or isinstance(configured, _compat.CustomGraphPass):
        return OpsKey(configured)
    return None
