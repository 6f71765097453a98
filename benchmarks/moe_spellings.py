"""The MoE spellings bench_moe.py times besides HF's and torchtitan's: the dense one (every expert on
every token, einsum, top-k gates) and transformers 4.x's per-expert loop over a ModuleList."""
import torch
import torch.nn.functional as F


class DenseMoE(torch.nn.Module):
    """softmax router, top-k gates scattered into [T, E], SwiGLU experts as einsums over all experts."""

    def __init__(self, cfg: dict):
        super().__init__()
        e, d, f = cfg["experts"], cfg["hidden"], cfg["ffn"]
        self.k = cfg["top_k"]
        self.router = torch.nn.Linear(d, e, bias=False)
        self.w_gate, self.w_up = (torch.nn.Parameter(torch.randn(e, d, f) * d ** -0.5) for _ in range(2))
        self.w_down = torch.nn.Parameter(torch.randn(e, f, d) * f ** -0.5)

    def forward(self, x):
        flat = x.view(-1, x.shape[-1])
        probs = F.softmax(self.router(flat).float(), dim=-1)
        weight, index = torch.topk(probs, self.k, dim=-1)
        gates = torch.zeros_like(probs).scatter(1, index, weight / weight.sum(-1, keepdim=True)).to(x.dtype)
        h = F.silu(torch.einsum("td,edf->tef", flat, self.w_gate)) * torch.einsum("td,edf->tef", flat, self.w_up)
        return torch.einsum("ted,te->td", torch.einsum("tef,efd->ted", h, self.w_down), gates).view_as(x)


class Expert(torch.nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.w1, self.w3 = torch.nn.Linear(d, f, bias=False), torch.nn.Linear(d, f, bias=False)
        self.w2 = torch.nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LoopMoE4x(torch.nn.Module):
    """transformers 4.x's MixtralSparseMoeBlock: the loop over range(num_experts), torch.where, index_add_."""

    def __init__(self, cfg: dict):
        super().__init__()
        e, d, f = cfg["experts"], cfg["hidden"], cfg["ffn"]
        self.k, self.num_experts = cfg["top_k"], e
        self.gate = torch.nn.Linear(d, e, bias=False)
        self.experts = torch.nn.ModuleList([Expert(d, f) for _ in range(e)])

    def forward(self, x):
        flat = x.view(-1, x.shape[-1])
        weights, selected = torch.topk(F.softmax(self.gate(flat), dim=1, dtype=torch.float), self.k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        final = torch.zeros_like(flat)
        mask = F.one_hot(selected, num_classes=self.num_experts).permute(2, 1, 0)
        for e in range(self.num_experts):
            idx, top_x = torch.where(mask[e])
            current = self.experts[e](flat[None, top_x].reshape(-1, flat.shape[-1])) * weights[top_x, idx, None]
            final.index_add_(0, top_x, current.to(x.dtype))
        return final.view_as(x)
