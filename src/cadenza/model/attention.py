"""Multi-head Latent Attention (MLA, DeepSeek-V2/V3).

Queries: q = W_qb RMSNorm(W_qa x) (or q = W_q x without q_lora), split per head into a
"nope" part and a RoPE part. Keys and values come from a small latent shared by all heads:

    [c_kv, k_pe] = W_kva x,   c_kv <- RMSNorm(c_kv),   k_pe <- RoPE(k_pe)  (one head, shared)
    [k_nope_h, v_h] = W_kvb c_kv  per head h,   k_h = [k_nope_h, k_pe]

so a KV cache only needs c_kv and k_pe per token (kv_lora_rank + qk_rope_head_dim numbers).
Scores are softmax_scale * q_h . k_h with causal masking; the output is W_o [v_1 .. v_H].
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from cadenza.config.model import ModelConfig
from cadenza.model.norm import RMSNorm
from cadenza.model.rope import apply_rope, softmax_scale
from cadenza.model.units import ADAMW, MATRIX, Units

if TYPE_CHECKING:
    from cadenza.model.kv_cache import LayerCache


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    record_max: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """softmax(scale * q k^T + causal/padding mask) v for q [B,H,T,d], k [B,H,S,d], v [B,H,S,dv].

    `mask` [B,1,T,S] (True = may attend) or None for plain causal attention with T == S.
    With `record_max`, also returns the per-head max of the scaled logits over the allowed
    (causal, non-padding) positions, shape [H]; that path materializes the scores.
    """
    if not record_max:
        causal = mask is None and q.shape[2] > 1
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale
        ), None
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is None:
        T, S = q.shape[2], k.shape[2]
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
    scores = scores.masked_fill(~mask, float("-inf"))
    max_logit = scores.detach().amax(dim=(0, 2, 3))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v), max_logit


class Attention(nn.Module):
    """MLA self-attention. Set `record_max_logit = True` to store `self.max_logit` [H] (the
    detached per-head max of the pre-softmax scaled logits over batch, queries and causal
    keys) on every forward, as MuonClip needs; it is overwritten by each forward."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.q_lora_rank = cfg.q_lora_rank
        self.kv_lora_rank = cfg.kv_lora_rank
        self.nope_dim = cfg.qk_nope_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        self.qk_dim = cfg.qk_head_dim
        self.interleave = cfg.rope_interleave
        self.scale = softmax_scale(cfg)
        dim, bias = cfg.hidden_size, cfg.attention_bias
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(dim, self.num_heads * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(dim, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(dim, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(
            self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, dim, bias=bias)
        self.record_max_logit = False
        self.max_logit: torch.Tensor | None = None
        # Injection point for context parallelism (set from outside, e.g. cadenza.parallel):
        # kv_gather(c_kv, k_pe, mask) -> (c_kv, k_pe, mask) over the whole sequence.
        self.kv_gather = None

    def param_units(self) -> dict[str, Units]:
        h = self.num_heads
        units = {
            "kv_a_proj_with_mqa.weight": MATRIX,
            "kv_b_proj.weight": Units.per_head("rows", h, self.nope_dim, self.v_dim),
            "o_proj.weight": Units.per_head("cols", h, self.v_dim),
        }
        q_heads = Units.per_head("rows", h, self.nope_dim, self.rope_dim)
        if self.q_lora_rank is None:
            units["q_proj.weight"] = q_heads
        else:
            units["q_a_proj.weight"] = MATRIX
            units["q_b_proj.weight"] = q_heads
        for name, module in self.named_children():
            if isinstance(module, nn.Linear) and module.bias is not None:
                units[f"{name}.bias"] = ADAMW
        return units

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        """x [B,T,D]; cos/sin [B or 1, T, rope_dim/2]; mask [B,1,T,S] or None (causal)."""
        B, T, _ = x.shape
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, self.num_heads, self.qk_dim).transpose(1, 2)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_pe = apply_rope(q_pe, cos[:, None], sin[:, None], self.interleave)

        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        k_pe = apply_rope(k_pe, cos, sin, self.interleave)
        if cache is not None:
            c_kv, k_pe = cache.update(c_kv, k_pe)
            if T == 1:
                out = self._absorbed(q_nope, q_pe, c_kv, k_pe, mask)
                return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.v_dim))
        elif self.kv_gather is not None:
            c_kv, k_pe, mask = self.kv_gather(c_kv, k_pe, mask)
        S = c_kv.shape[1]

        kv = self.kv_b_proj(c_kv).view(B, S, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_pe[:, None].expand(B, self.num_heads, S, self.rope_dim)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)

        out, max_logit = attend(q, k, v, mask, self.scale, self.record_max_logit)
        if max_logit is not None:
            self.max_logit = max_logit
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.v_dim))

    def _absorbed(self, q_nope, q_pe, c_kv, k_pe, mask) -> torch.Tensor:
        """Decoding against the latent cache without expanding it (DeepSeek-V2's absorption):

            q_nope . (W_uk c) = (W_uk^T q_nope) . c,   sum_s p_s W_uv c_s = W_uv (sum_s p_s c_s)

        so each step costs O(S * kv_lora_rank) per head instead of re-expanding all S cached
        latents through kv_b_proj. Returns [B, H, T, v_head_dim]."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, -1)
        w_uk, w_uv = w[:, : self.nope_dim], w[:, self.nope_dim :]
        q_lat = torch.matmul(q_nope, w_uk)  # [B, H, T, r]
        c = c_kv[:, None]  # [B, 1, S, r], shared by all heads
        scores = torch.matmul(q_lat, c.transpose(-1, -2))
        scores = (scores + torch.matmul(q_pe, k_pe[:, None].transpose(-1, -2))) * self.scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        if self.record_max_logit:
            self.max_logit = scores.detach().amax(dim=(0, 2, 3))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_lat.dtype)
        return torch.matmul(torch.matmul(probs, c), w_uv.transpose(-1, -2))
