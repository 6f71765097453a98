"""Legality checks shared by the library's patterns (each returns None, or the reason it fails)."""
import torch

from fusion_compiler.codegen.launch import MAX_ROW, can_launch
from fusion_compiler.ops import SUPPORTED_DTYPES


def kernel_inputs(match, complex_ok: bool = False) -> str | None:
    """All tensor inputs on one device our kernels run on, in a dtype they compute correctly."""
    tensors = match.tensor_inputs()
    devices = {t.device for t in tensors}
    # mixed devices: a fused kernel reads every input from one device
    if len(devices) > 1:
        return f"inputs on several devices: {sorted(str(d) for d in devices)}"
    why = can_launch(next(iter(devices)))
    # device without a Triton backend (CPU without the interpreter, MPS, ...)
    if why:
        return why
    for t in tensors:
        # complex inputs are allowed only where the pattern turns them into real cos/sin
        if complex_ok and t.dtype == torch.complex64:
            continue
        # float64 and integer tensors: the kernels compute in fp32
        if t.dtype not in SUPPORTED_DTYPES:
            return f"dtype {str(t.dtype).replace('torch.', '')} not supported (float32, float16, bfloat16)"
    return None


def row_width(n: int) -> str | None:
    # empty rows: nothing to normalize over
    if n == 0:
        return "empty last dimension"
    # wider rows do not fit one program's registers
    if n > MAX_ROW:
        return f"last dimension {n} > {MAX_ROW}"
    return None
