"""Legality checks shared by the library's patterns (each returns None, or the reason it fails)."""
import torch

from fusion_compiler.codegen.launch import MAX_ROW, can_launch
from fusion_compiler.ops import SUPPORTED_DTYPES


def one_device(tensors) -> str | None:
    """A fused kernel reads every input from one device."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        return f"inputs on several devices: {sorted(str(d) for d in devices)}"
    return None


def float_dtype(t: torch.Tensor) -> str | None:
    """The kernels compute in fp32 from fp32/fp16/bf16 inputs (float64 would lose precision)."""
    if t.dtype not in SUPPORTED_DTYPES:
        return f"dtype {str(t.dtype).replace('torch.', '')} not supported (float32, float16, bfloat16)"
    return None


def kernel_inputs(match, complex_ok: bool = False) -> str | None:
    """All tensor inputs on one device our Triton kernels run on, in a dtype they compute correctly."""
    tensors = match.tensor_inputs()
    # mixed devices, or a device without a Triton backend (CPU without the interpreter, MPS, ...)
    why = one_device(tensors) or can_launch(tensors[0].device)
    if why:
        return why
    for t in tensors:
        # complex inputs are allowed only where the pattern turns them into real cos/sin
        if complex_ok and t.dtype == torch.complex64:
            continue
        why = float_dtype(t)
        if why:
            return why
    return None


def row_width(n: int) -> str | None:
    # empty rows: nothing to normalize over
    if n == 0:
        return "empty last dimension"
    # wider rows do not fit one program's registers
    if n > MAX_ROW:
        return f"last dimension {n} > {MAX_ROW}"
    return None
