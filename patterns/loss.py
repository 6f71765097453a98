"""Loss family: cross-entropy as one kernel that computes the loss and its gradient in one pass, and
the LM head's linear fused in, in chunks of tokens, so the logits never exist whole.

Spellings matched (any ignore_index; mean, sum or none):
    F.cross_entropy(logits, target) / nn.CrossEntropyLoss / F.nll_loss(F.log_softmax(logits, -1), target)
    HF causal-LM loss: logits.float(), shifted labels, flattened, then F.cross_entropy
    label smoothing (mean, sum): as F.cross_entropy(label_smoothing=eps) decomposes; the two scalars
    it leaves, 1 - eps and eps / V, are checked to agree
    the same preceded by the LM head, F.linear(h, W[, b]) (tied or untied W: it is one input either
    way), optionally logit soft-capping tanh(logits / cap) * cap (Gemma 2), or label smoothing
    (without bias or soft-cap): mean and sum only (the gradients are computed in the forward, which
    a per-token incoming gradient would invalidate)
Logits upcast to fp32 before the loss are read in their own dtype (the cast is not materialized).
When the logits are also returned (HF returns outputs.logits) the region is a near-miss, unless
FusionConfig(drop_logits=True), which returns an empty tensor in their place in training.
Not matched: class weights, class-probability targets. A mean over no valid token is 0 where eager
gives NaN.
"""
import torch
import torch.nn.functional as F

from fusion_compiler import cost
from fusion_compiler.codegen.launch import can_launch
from fusion_compiler.pattern import register_pattern

from .checks import float_dtype, one_device

IGNORE = -7777  # distinctive example value: the int literal equal to it binds `ignore_index`
CAP = 29.87654  # ... the float literal equal to it binds the soft-cap
KEEP = 0.987654  # ... 1 - label smoothing
SMOOTH_PER_CLASS = 0.00123457  # ... label smoothing / vocabulary size
_LOGITS, _TARGET = torch.randn(6, 10), torch.randint(0, 10, (6,))
_H, _W, _B = torch.randn(6, 8), torch.randn(10, 8), torch.randn(10)


def _targets_legal(rows: int, dtype: torch.dtype, device: torch.device, target) -> str | None:
    # a device without a Triton backend, or float64 logits
    why = can_launch(device) or float_dtype(torch.empty(0, dtype=dtype))
    if why:
        return why
    # class-probability targets, or targets not one per row
    if target.dim() != 1 or target.dtype != torch.int64 or target.shape[0] != rows:
        return f"target {target.dtype}{list(target.shape)} is not int64 ({rows},)"
    return None


def _legal(match) -> str | None:
    logits, target = match.input_values()[:2]
    why = one_device((logits, target))
    if why:
        return why
    # a batch layout other than (N, V)
    if logits.dim() != 2:
        return f"logits {list(logits.shape)} are not (N, V)"
    return _targets_legal(logits.shape[0], logits.dtype, logits.device, target)


def _smoothing(keep: float, per_class: float, vocab: int) -> float | None:
    """eps from the two scalars of the decomposition, or None when they disagree."""
    eps = 1.0 - keep
    return eps if abs(per_class * vocab - eps) <= 1e-6 * max(1.0, eps) else None


def _smoothing_legal(keep: float, per_class: float, vocab: int) -> str | None:
    if _smoothing(keep, per_class, vocab) is None:
        return f"scalars {keep} and {per_class} are not 1 - eps and eps / {vocab} of one label smoothing"
    return None


def _smooth_legal(match) -> str | None:
    logits, _, _, keep, per_class = match.input_values()
    return _legal(match) or _smoothing_legal(keep, per_class, logits.shape[-1])


def _linear_legal(match) -> str | None:
    tensors = match.tensor_inputs()  # h, W, [b,] target
    h, w, target = tensors[0], tensors[1], tensors[-1]
    why = one_device(tensors)
    if why:
        return why
    # one dtype for the matmul (h, W and b)
    if any(t.dtype != h.dtype for t in tensors[:-1]):
        return f"hidden {h.dtype} / weight {w.dtype} (/ bias) dtypes differ"
    if h.dim() != 2 or w.dim() != 2 or h.shape[1] != w.shape[1]:
        return f"hidden {list(h.shape)} / weight {list(w.shape)} are not (N, H) / (V, H)"
    return _targets_legal(h.shape[0], h.dtype, h.device, target)


# --- cross-entropy on logits -------------------------------------------------------------------------
def _register(reduction: str) -> None:
    def cross_entropy(logits, target, ignore_index):
        return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)

    cross_entropy.__doc__ = (f"before: F.cross_entropy(logits, target, ignore_index=i, reduction={reduction!r})  "
                             f"after: fusion.cross_entropy(logits, target, i, {reduction!r}, 0.0)[0]")
    register_pattern(f"cross_entropy_{reduction}", family="loss", kernel="cross_entropy", search=cross_entropy,
                     replacement=lambda logits, target, ignore_index: torch.ops.fusion.cross_entropy(
                         logits, target, ignore_index, reduction, 0.0)[0],
                     example_inputs=[_LOGITS, _TARGET, IGNORE], can_apply=_legal, priority=20)


def _smoothed_loss(logits, target, ignore_index, keep, per_class, reduction):
    """F.cross_entropy(logits, target, ignore_index=i, label_smoothing=eps) as it decomposes:
    (1 - eps) * nll + (eps / V) * sum of -log_softmax over classes and valid rows (mean: / valid rows)."""
    lsm = torch.log_softmax(logits, -1)
    nll = F.nll_loss(lsm, target, ignore_index=ignore_index, reduction=reduction)
    ignored = target == ignore_index
    smooth = (-lsm.sum(-1)).masked_fill(ignored, 0.0).sum()
    if reduction == "mean":
        smooth = smooth / (~ignored).sum()
    return nll * keep + smooth * per_class


def _register_smoothed(reduction: str) -> None:
    def smoothed(logits, target, ignore_index, keep, per_class):
        """before: F.cross_entropy(logits, target, ignore_index=i, label_smoothing=eps)
        after:  fusion.cross_entropy(logits, target, i, reduction, eps)[0]"""
        return _smoothed_loss(logits, target, ignore_index, keep, per_class, reduction)

    def replacement(logits, target, ignore_index, keep, per_class):
        eps = _smoothing(keep, per_class, logits.shape[-1])
        return torch.ops.fusion.cross_entropy(logits, target, ignore_index, reduction, eps)[0]

    register_pattern(f"cross_entropy_smoothed_{reduction}", family="loss", kernel="cross_entropy", search=smoothed,
                     replacement=replacement, example_inputs=[_LOGITS, _TARGET, IGNORE, KEEP, SMOOTH_PER_CLASS],
                     can_apply=_smooth_legal, priority=25)


for _reduction in ("mean", "sum", "none"):
    _register(_reduction)
for _reduction in ("mean", "sum"):
    _register_smoothed(_reduction)


# --- linear + cross-entropy --------------------------------------------------------------------------
def _lce(h, w, b, target, ignore_index, reduction, cap=0.0, eps=0.0):
    """The chunked op; gradients are computed in the forward only when something needs them."""
    with_grad = reduction != "none" and torch.is_grad_enabled() and \
        any(t is not None and t.requires_grad for t in (h, w, b))
    return torch.ops.fusion.linear_cross_entropy(h, w, b, target, ignore_index, reduction, eps, cap, with_grad)[0]


def _register_linear(reduction: str, bias: bool, softcap: bool, smoothed: bool) -> None:
    def unpack(args):
        """(h, W, b, target, ignore_index, cap, keep, per_class) from the arguments:
        (h, W, [b,] target, i[, cap][, keep, per_class])."""
        h, w, *rest = args
        b = rest.pop(0) if bias else None
        target, ignore_index, *rest = rest
        cap = rest.pop(0) if softcap else 0.0
        keep, per_class = rest if smoothed else (1.0, 0.0)
        return h, w, b, target, ignore_index, cap, keep, per_class

    def search(*args):
        h, w, b, target, ignore_index, cap, keep, per_class = unpack(args)
        logits = F.linear(h, w, b)
        if softcap:
            logits = torch.tanh(logits / cap) * cap
        if smoothed:
            return _smoothed_loss(logits, target, ignore_index, keep, per_class, reduction)
        return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)

    def replacement(*args):
        h, w, b, target, ignore_index, cap, keep, per_class = unpack(args)
        eps = _smoothing(keep, per_class, w.shape[0]) if smoothed else 0.0
        return _lce(h, w, b, target, ignore_index, reduction, cap, eps)

    def legal(match) -> str | None:
        why = _linear_legal(match)
        if why or not smoothed:
            return why
        *_, keep, per_class = unpack(match.input_values())
        return _smoothing_legal(keep, per_class, match.tensor_inputs()[1].shape[0])

    examples = [_H, _W, *([_B] if bias else []), _TARGET, IGNORE, *([CAP] if softcap else []),
                *([KEEP, SMOOTH_PER_CLASS] if smoothed else [])]
    name = ("linear_" + ("bias_" if bias else "") + ("softcap_" if softcap else "") + "cross_entropy_"
            + ("smoothed_" if smoothed else "") + reduction)
    search.__doc__ = (f"before: F.cross_entropy({'softcap(' if softcap else ''}F.linear(h, W{', b' if bias else ''})"
                      f"{')' if softcap else ''}, target, {'label_smoothing=eps, ' if smoothed else ''}"
                      f"reduction={reduction!r})   after: fusion.linear_cross_entropy(...) in chunks of tokens")
    register_pattern(name, family="loss", kernel="linear_cross_entropy", search=search, replacement=replacement,
                     example_inputs=examples, can_apply=legal, should_apply=cost.estimate_linear_cross_entropy,
                     priority=40 + 2 * softcap + bias + 5 * smoothed)


for _reduction in ("mean", "sum", "none"):
    for _bias in (False, True):
        for _softcap in (False, True):
            for _smoothed in (False, True) if _reduction != "none" else (False,):
                _register_linear(_reduction, _bias, _softcap, _smoothed)
