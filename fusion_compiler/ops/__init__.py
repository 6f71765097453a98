"""The project's ops: torch.library custom ops (namespace `fusion`) whose forward and backward run our
Triton kernels. Patterns rewrite regions into calls of these ops; they are usable directly too.

    torch.ops.fusion.rms_norm(x, weight, eps)              -> (y, rstd)
    torch.ops.fusion.add_rms_norm(x, residual, weight, eps) -> (y, x + residual, rstd)
    torch.ops.fusion.rms_norm_fp8 / add_rms_norm_fp8(...)   -> the same + (y in e4m3 [rows, N], its scale [rows, 1])
    torch.ops.fusion.layer_norm(x, weight, bias, eps)       -> (y, mean, rstd)
    torch.ops.fusion.rope(x, cos, sin, interleaved)         -> x rotated
    torch.ops.fusion.glu(gate, up, act)                     -> act(gate) * up
    torch.ops.fusion.glu_packed(x, act, gate_first)         -> the same on the two halves of x
    torch.ops.fusion.glu_fp8 / glu_packed_fp8(...)          -> (y, y in e4m3 [rows, N], its scale [rows, 1])
    torch.ops.fusion.cross_entropy(logits, target, ignore_index, reduction, label_smoothing)
                                                            -> (loss, d loss / d logits)
    torch.ops.fusion.linear_cross_entropy(h, w, b, target, ignore_index, reduction, label_smoothing,
                                          softcap, with_grad)  -> (loss, dh, dw, db), in chunks of tokens
    torch.ops.fusion.linear_cross_entropy_backward(h, w, b, target, dloss, ignore_index, label_smoothing,
                                                   softcap)  -> (dh, dw, db) of per-token losses
    torch.ops.fusion.embedding(weight, indices, padding_idx)  -> weight[indices]; ATen's own backward
    torch.ops.fusion.multi_tensor_apply(program, reads, writes, scalars)  -> None: a lane program
                                                            over many tensors, in place, one launch
    torch.ops.fusion.multi_tensor_sum_squares(tensors)      -> each tensor's sum of squares, one launch
    torch.ops.fusion.gemm_epilogue(epilogue, a, b, sides, shape, out_dtype, save_product)
                                                            -> (epilogue(a @ b), a @ b or empty): one
                                                            GEMM kernel with the chain in its epilogue
    torch.ops.fusion.fp8_linear(x, w, recipe, emulate)      -> x @ w^T with all three training GEMMs in
                                                            FP8 (dynamic per-row scales)
    torch.ops.fusion.fp8_quantize_tensorwise(t, transposed, emulate) -> (t and t^T in e4m3, scale [])
    torch.ops.fusion.fp8_linear_tensorwise(x, w, <casts of x and w>, emulate)
                                                            -> x @ w^T in FP8 (per-tensor scales); its
                                                            backward reads only the FP8 transposes
    torch.ops.fusion.fp8_linear_tensorwise_cross_entropy(x, w, <casts>, target, ignore_index, reduction, emulate)
                                                            -> (logits, loss, saved lse, amax, count): the
                                                            LM head in FP8 and its cross-entropy, whose
                                                            backward writes the logits' gradient in FP8
    torch.ops.fusion.moe_experts(x, index, weight, weights, layout, act, impl)
                                                            -> (routed experts' sum, saved a1, h, perm,
                                                            offsets, rows): grouped GEMMs over sorted rows
    torch.ops.fusion.topk(x, k)                             -> torch.topk(x, k, -1) of short rows, one launch
"""
from . import elementwise, embedding, fp8, fp8_cross_entropy, gemm, loss, moe, multi_tensor, norm, topk  # noqa: F401  (registers the ops)

SUPPORTED_DTYPES = norm.SUPPORTED_DTYPES
