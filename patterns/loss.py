"""Loss family: cross-entropy as one kernel that computes the loss and its gradient in one pass.

Spellings matched (any ignore_index; mean, sum or none):
    F.cross_entropy(logits, target) / nn.CrossEntropyLoss / F.nll_loss(F.log_softmax(logits, -1), target)
    HF causal-LM loss: logits.float(), shifted labels, flattened, then F.cross_entropy
Logits upcast to fp32 before the loss are read in their own dtype (the cast is not materialized).
Not yet: label smoothing in the graph, class weights, the LM-head linear
fused in (chunked linear + cross-entropy); a mean over no valid token is 0 where eager gives NaN.
"""
import torch
import torch.nn.functional as F

from fusion_compiler.codegen.launch import can_launch
from fusion_compiler.pattern import register_pattern

from .checks import float_dtype, one_device

IGNORE = -7777  # distinctive example value: the int literal equal to it binds `ignore_index`


def _legal(match) -> str | None:
    logits, target, _ = match.input_values()
    # mixed devices, a device without a Triton backend, or float64 logits
    why = one_device((logits, target)) or can_launch(logits.device) or float_dtype(logits)
    if why:
        return why
    # class-probability targets or a batch layout other than (N, V) / (N,)
    if logits.dim() != 2 or target.dim() != 1 or target.dtype != torch.int64 or target.shape[0] != logits.shape[0]:
        return f"logits {list(logits.shape)} / target {target.dtype}{list(target.shape)} are not (N, V) / int64 (N,)"
    return None


def _register(reduction: str) -> None:
    def cross_entropy(logits, target, ignore_index):
        return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)

    cross_entropy.__doc__ = (f"before: F.cross_entropy(logits, target, ignore_index=i, reduction={reduction!r})  "
                             f"after: fusion.cross_entropy(logits, target, i, {reduction!r}, 0.0)[0]")
    register_pattern(f"cross_entropy_{reduction}", family="loss", kernel="cross_entropy", search=cross_entropy,
                     replacement=lambda logits, target, ignore_index: torch.ops.fusion.cross_entropy(
                         logits, target, ignore_index, reduction, 0.0)[0],
                     example_inputs=[torch.randn(6, 10), torch.randint(0, 10, (6,)), IGNORE], can_apply=_legal,
                     priority=20)


for _reduction in ("mean", "sum", "none"):
    _register(_reduction)
