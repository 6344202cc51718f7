"""A miniature MoE language model with the structure cadenza.model promises (for tests only).

Same injection points as the real model: `layers[i].attn` takes explicit positions and an
optional `kv_gather` hook; `layers[i].mlp` is a dense MLP or a MoE whose `.experts` are
called on tokens grouped by expert with per-expert counts. Written independently of
cadenza.parallel so tests can compare parallel runs against it on one process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.kv_gather = None

    def forward(self, x, positions):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        k_pos = positions
        if self.kv_gather is not None:
            k, v, k_pos = self.kv_gather(k, v, positions=positions)
        mask = k_pos.unsqueeze(-2) <= positions.unsqueeze(-1)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
        )
        return self.o(o.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d: int, i: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 2 * i, bias=False)
        self.down = nn.Linear(i, d, bias=False)

    def forward(self, x):
        g, u = self.up(x).chunk(2, -1)
        return self.down(F.silu(g) * u)


class Experts(nn.Module):
    def __init__(self, e: int, d: int, i: int) -> None:
        super().__init__()
        self.w_gate = nn.Parameter(torch.randn(e, i, d) * 0.1)
        self.w_up = nn.Parameter(torch.randn(e, i, d) * 0.1)
        self.w_down = nn.Parameter(torch.randn(e, d, i) * 0.1)

    def forward(self, x, counts):
        idx = torch.repeat_interleave(torch.arange(len(counts)), counts)
        g = torch.einsum("nd,nid->ni", x, self.w_gate[idx])
        u = torch.einsum("nd,nid->ni", x, self.w_up[idx])
        return torch.einsum("ni,ndi->nd", F.silu(g) * u, self.w_down[idx])


class MoE(nn.Module):
    def __init__(self, d: int, i: int, e: int, k: int) -> None:
        super().__init__()
        self.k = k
        self.router = nn.Linear(d, e, bias=False)
        self.experts = Experts(e, d, i)
        self.shared = MLP(d, i)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, expert = torch.sigmoid(self.router(x)).topk(self.k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        flat = expert.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.router.out_features)
        token = order // self.k
        y = self.experts(x[token], counts) * weights.reshape(-1)[order, None]
        out = torch.zeros_like(x).index_add(0, token, y)
        return (out + self.shared(x)).reshape(shape)


class Block(nn.Module):
    def __init__(self, d, heads, i, e, k, moe: bool) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(d)
        self.attn = Attention(d, heads)
        self.mlp_norm = nn.RMSNorm(d)
        self.mlp = MoE(d, i, e, k) if moe else MLP(d, 2 * i)

    def forward(self, x, positions):
        x = x + self.attn(self.attn_norm(x), positions)
        return x + self.mlp(self.mlp_norm(x))


class ToyLM(nn.Module):
    def __init__(self, vocab=64, d=16, heads=2, i=8, e=8, k=2, layers=2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, heads, i, e, k, moe=j > 0) for j in range(layers))
        self.norm = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids, positions=None):
        if positions is None:
            positions = torch.arange(input_ids.shape[1])
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h, positions)
        return self.lm_head(self.norm(h))
