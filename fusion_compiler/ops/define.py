"""How the project's functional ops are registered: `@fusion_op("fusion::name")` on a typed function.

The op is the same as `torch.library.custom_op` makes (schema inferred from the annotations,
`register_fake`, `register_autograd`, `torch.ops.fusion.name`), through the public `torch.library`
calls, with the function registered at the dispatcher's CUDA and CPU keys directly. custom_op reaches
the function through its own Python layers (an autograd kernel that redispatches, a backend kernel
wrapped in a Dynamo-disabled frame, alias checks): 21 us of host time a call on the H200 machine
against 3 us here (benchmarks/host_overhead.py), paid by every call a compiled graph makes.
Ops that mutate an input stay on custom_op, which bumps the mutated tensors' version counters.
"""
import functools

import torch

_LIBRARIES: dict[str, torch.library.Library] = {}


class FusionOp:
    """A functional op registered at the CUDA and CPU keys; calls go straight to its OpOverload."""

    def __init__(self, qualname: str, fn):
        namespace, name = qualname.split("::")
        if namespace not in _LIBRARIES:
            _LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")
        lib = _LIBRARIES[namespace]
        lib.define(name + torch.library.infer_schema(fn, mutates_args=()), tags=(torch.Tag.pt2_compliant_tag,))
        for key in ("CUDA", "CPU"):
            lib.impl(name, fn, key)
        functools.update_wrapper(self, fn)
        self.qualname = qualname
        self.op = getattr(getattr(torch.ops, namespace), name).default

    def register_fake(self, fn):
        torch.library.register_fake(self.qualname, fn)
        return fn

    def register_autograd(self, backward, setup_context=None):
        torch.library.register_autograd(self.qualname, backward, setup_context=setup_context)

    def __call__(self, *args, **kwargs):
        return self.op(*args, **kwargs)


def fusion_op(qualname: str):
    """Decorator: `fn` becomes the functional op `qualname` ("namespace::name")."""
    return lambda fn: FusionOp(qualname, fn)
