"""Embedding family: the table lookup of a trained low-precision table (an LLM's token embedding)
keeps ATen's CUDA backward (fusion::embedding, fusion_compiler/ops/embedding.py) instead of
Inductor's fp32 scatter-add into a copy of the whole table.

    before: aten.embedding(weight, ids, padding_idx)      after: fusion.embedding(weight, ids, padding_idx)
nn.Embedding, F.embedding and HF's embed_tokens all trace to the one ATen op; scale_grad_by_freq and
sparse gradients keep their ATen call (the literals differ)."""
import torch

from fusion_compiler import cost
from fusion_compiler.pattern import register_pattern

from .checks import float_dtype, one_device


def embedding(weight, indices, padding_idx):
    return torch.ops.aten.embedding.default(weight, indices, padding_idx)


def _replacement(weight, indices, padding_idx):
    return torch.ops.fusion.embedding(weight, indices, padding_idx)


def _legal(match) -> str | None:
    weight, indices = match.tensor_inputs()[:2]
    why = one_device((weight, indices)) or float_dtype(weight)
    if why:
        return why
    # a 2-D table (ATen's backward writes (V, H))
    if weight.dim() != 2:
        return f"table of {weight.dim()} dims"
    # the CPU backward accumulates a bf16/fp16 table in its own dtype (CUDA's in fp32)
    if weight.device.type != "cuda" and weight.dtype != torch.float32:
        return f"{weight.dtype} table on {weight.device.type}: ATen's backward there accumulates in {weight.dtype}"
    return None


register_pattern("embedding", family="embedding", search=embedding, replacement=_replacement,
                 example_inputs=[torch.randn(10, 4), torch.randint(0, 10, (3, 5)), 7],
                 can_apply=_legal, should_apply=cost.estimate_embedding, priority=5)
