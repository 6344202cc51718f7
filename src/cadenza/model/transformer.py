"""The decoder: embeddings, `num_hidden_layers` blocks (the first `first_k_dense_replace`
with a dense MLP, the rest MoE), final RMSNorm and the output head.

    h = embed(ids);  for each block: h += attn(norm(h));  h += mlp(norm(h))
    logits = lm_head(norm(h))
"""

from __future__ import annotations

import torch
from torch import nn

from cadenza.config.model import ModelConfig
from cadenza.model.attention import Attention
from cadenza.model.kv_cache import KVCache
from cadenza.model.loss import linear_cross_entropy
from cadenza.model.mlp import MLP
from cadenza.model.moe import MoE
from cadenza.model.norm import RMSNorm
from cadenza.model.rope import RotaryEmbedding
from cadenza.model.units import ADAMW, Units


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer_idx)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: MLP | MoE = (
            MoE(cfg) if cfg.is_moe_layer(layer_idx) else MLP(cfg.hidden_size, cfg.intermediate_size)
        )

    def forward(self, h, cos, sin, mask=None, cache=None) -> torch.Tensor:
        h = h + self.attn(self.attn_norm(h), cos, sin, mask, cache)
        return h + self.mlp(self.mlp_norm(h))


class CausalLM(nn.Module):
    """DeepSeek-V3 / Kimi K2 causal language model on one process (no torch.distributed)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rope = RotaryEmbedding(cfg)
        if self.embed.weight.device.type != "meta":
            self.init_weights()

    def tie_weights(self) -> None:
        """Share the output head with the embedding if the config says so (call again after
        `to_empty()`, which re-creates each parameter separately)."""
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Normal(0, initializer_range) matrices, unit norms, zero biases and router bias.

        Also recomputes non-persistent buffers, so call it after `to_empty()` from meta."""
        std = self.cfg.initializer_range
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=generator)
        for m in self.modules():
            if isinstance(m, MoE):
                m.router.e_score_correction_bias.zero_()
                m.tokens_per_expert.zero_()
        self.rope.reset_parameters()

    def param_units(self) -> dict[str, Units]:
        return {"embed.weight": ADAMW, "lm_head.weight": ADAMW}

    def moe_layers(self) -> list[MoE]:
        return [b.mlp for b in self.layers if isinstance(b.mlp, MoE)]

    def update_router_biases(self, speed: float | None = None) -> None:
        """Aux-loss-free balancing step on every MoE layer (see MoE.update_router_bias)."""
        for moe in self.moe_layers():
            moe.update_router_bias(speed)

    def hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states [B, T, D] (after the last norm) for input_ids [B, T].

        positions [B or 1, T]: RoPE positions (default: 0.. for each sequence, continuing
        the cache). cache: appended to, so decoding continues from it. valid [B, T] bool:
        False marks padding tokens that nothing attends to (default: all real)."""
        B, T = input_ids.shape
        mask = None
        if cache is not None:
            if valid is None:
                valid = torch.ones(B, T, dtype=torch.bool, device=input_ids.device)
            cache_positions, mask = cache.begin(valid)
            positions = cache_positions if positions is None else positions
        elif valid is not None and not bool(valid.all()):
            positions = (
                (valid.long().cumsum(1) - 1).clamp(min=0) if positions is None else positions
            )
            i = torch.arange(T, device=input_ids.device)
            causal = i[None, :] <= i[:, None]
            mask = (
                (causal[None] & valid[:, None, :])
                | torch.eye(T, dtype=torch.bool, device=valid.device)
            )[:, None]
        if positions is None:
            positions = torch.arange(T, device=input_ids.device)[None]
        cos, sin = self.rope(positions)
        h = self.embed(input_ids)
        for i, block in enumerate(self.layers):
            h = block(h, cos, sin, mask, cache.layer(i) if cache is not None else None)
        if cache is not None:
            cache.commit()
        return self.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output head on (a selection of) final hidden states [..., D] -> [..., V]."""
        return self.lm_head(hidden)

    def loss(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        ignore_index: int = -100,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Mean next-token cross-entropy, computed without materializing all the logits.

        targets [B, T]: the token each position should predict (ignore_index: skip); default:
        input_ids shifted left by one, so the last position predicts nothing."""
        if targets is None:
            targets = torch.full_like(input_ids, ignore_index)
            targets[:, :-1] = input_ids[:, 1:]
        hidden = self.hidden(input_ids, positions)
        return linear_cross_entropy(hidden, self.lm_head.weight, targets, ignore_index)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.logits(self.hidden(input_ids, positions, cache, valid))
