"""Parameter counts of a model config, total and activated per token, built on the meta
device (no memory is allocated, so Kimi K2's 1T parameters are counted on a laptop).

"Activated" counts every parameter a token's forward pass touches: embedding row lookup
counted as the whole embedding matrix (the usual convention for DeepSeek-V3 / Kimi K2's
published 37B / 32B figures), attention, dense MLPs, shared experts, routers, norms, the
output head, and num_experts_per_tok of the n_routed_experts routed experts per MoE layer.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from cadenza.config.model import ModelConfig


def _category(name: str) -> str:
    if name.startswith("embed."):
        return "embedding"
    if name.startswith("lm_head."):
        return "lm_head"
    if ".experts." in name:
        return "routed experts"
    if ".shared." in name:
        return "shared experts"
    if ".router." in name:
        return "routers"
    if ".attn." in name and "norm" not in name:
        return "attention"
    if ".mlp." in name:
        return "dense MLP"
    return "norms"


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Counts per category plus 'total', 'activated' and 'activated (no embedding)'."""
    from cadenza.model.transformer import CausalLM

    with torch.device("meta"):
        model = CausalLM(cfg)
    counts: dict[str, int] = defaultdict(int)
    for name, p in model.named_parameters():  # tied weights appear once
        counts[_category(name)] += p.numel()
    total = sum(counts.values())
    routed = counts.get("routed experts", 0)
    active_routed = routed * cfg.num_experts_per_tok // max(cfg.n_routed_experts, 1)
    out = dict(counts)
    out["routed experts (activated)"] = active_routed
    out["total"] = total
    out["activated"] = total - routed + active_routed
    out["activated (no embedding)"] = out["activated"] - counts.get("embedding", 0)
    return out
