"""Profile HF rotate_half RoPE fwd+bwd under Inductor and under the fusion backend: kernel table."""
import torch
from torch.profiler import ProfilerActivity, profile

import fusion_compiler as fc
from bench_norm_elementwise import hf_rope

DT = torch.bfloat16
bsz, seq, heads, kv, d = 16, 2048, 16, 4, 128
q = torch.randn(bsz, seq, heads, d, device="cuda", dtype=DT).transpose(1, 2).requires_grad_()
k = torch.randn(bsz, seq, kv, d, device="cuda", dtype=DT).transpose(1, 2).requires_grad_()
theta = torch.randn(bsz, seq, d, device="cuda")
cos, sin = theta.cos().to(DT), theta.sin().to(DT)
for name, be in (("inductor", "inductor"), ("fusion", fc.backend(cost_model="always"))):
    fn = torch.compile(hf_rope, backend=be, dynamic=False)
    out = fn(q, k, cos, sin)
    g = [torch.randn_like(o) for o in out]
    for _ in range(3):
        torch.autograd.grad(fn(q, k, cos, sin), (q, k), g)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            torch.autograd.grad(fn(q, k, cos, sin), (q, k), g)
        torch.cuda.synchronize()
    print(name)
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=8, max_name_column_width=60))
