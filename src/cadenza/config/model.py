"""Model config: the DeepSeek-V3 architecture as published in its Hugging Face config.json.

Field names follow the Hugging Face config so a checkpoint's config.json maps onto this
dataclass one to one (see cadenza.model.hf_io for the translation of the few that differ).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RopeScaling:
    """YaRN context extension (DeepSeek-V3 / Kimi K2). type="none" disables it."""

    type: str = "none"  # "none" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    # Round the YaRN correction range to whole dimensions (Hugging Face's default).
    truncate: bool = True
    # Scale of cos/sin; None: derived from factor, mscale and mscale_all_dim as in YaRN.
    attention_factor: float | None = None


@dataclass
class ModelConfig:
    vocab_size: int = 4096
    hidden_size: int = 128
    intermediate_size: int = 256  # dense MLP width (first_k_dense_replace layers)
    moe_intermediate_size: int = 64  # per routed / shared expert width
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    q_lora_rank: int | None = 64  # None: q_proj directly from hidden
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    n_group: int = 2
    topk_group: int = 1
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    scoring_func: str = "sigmoid"
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    # DeepSeek checkpoints store the rotary dims as interleaved pairs (x0, x1), (x2, x3), ...
    rope_interleave: bool = True
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # Multi-token-prediction layers stored after the main layers in hub checkpoints; cadenza
    # does not run them (their weights are skipped on load).
    num_nextn_predict_layers: int = 0
    # Aux-loss-free balancing: step size of the e_score_correction_bias update.
    bias_update_speed: float = 1e-3

    def __post_init__(self) -> None:
        problems = []
        if self.n_routed_experts % max(self.n_group, 1):
            problems.append(
                f"n_routed_experts={self.n_routed_experts} not divisible by n_group={self.n_group}"
            )
        if self.topk_group > self.n_group:
            problems.append(f"topk_group={self.topk_group} > n_group={self.n_group}")
        if self.num_experts_per_tok > self.n_routed_experts:
            problems.append("num_experts_per_tok > n_routed_experts")
        elif (
            self.n_routed_experts
            and self.n_group
            and (
                self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group)
            )
        ):
            problems.append(
                f"num_experts_per_tok={self.num_experts_per_tok} > topk_group * experts per group"
                f" = {self.topk_group * (self.n_routed_experts // self.n_group)}"
            )
        if self.n_group < 1 or self.topk_group < 1:
            problems.append(f"n_group={self.n_group} and topk_group={self.topk_group} must be >= 1")
        if self.scoring_func != "sigmoid":
            problems.append(f"scoring_func={self.scoring_func!r}: only 'sigmoid' is supported")
        if self.hidden_act != "silu":
            problems.append(f"hidden_act={self.hidden_act!r}: only 'silu' is supported")
        if self.rope_scaling.type not in ("none", "yarn"):
            problems.append(
                f"rope_scaling.type={self.rope_scaling.type!r}: expected 'none' or 'yarn'"
            )
        if self.first_k_dense_replace > self.num_hidden_layers:
            problems.append("first_k_dense_replace > num_hidden_layers")
        if self.qk_rope_head_dim % 2:
            problems.append(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")
        if problems:
            raise ValueError("invalid model config: " + "; ".join(problems))

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and self.n_routed_experts > 0


def tiny_model() -> ModelConfig:
    """Small enough to pretrain on 2 CPU cores in minutes; every architectural feature on."""
    return ModelConfig()


def k2_model() -> ModelConfig:
    """Kimi K2 (DeepSeek-V3 architecture) shapes, as in its published config.json."""
    return ModelConfig(
        vocab_size=163840,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        num_attention_heads=64,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=384,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.827,
        rope_theta=50000.0,
        rope_scaling=RopeScaling(
            type="yarn",
            factor=32.0,
            original_max_position_embeddings=4096,
            beta_fast=1.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
        max_position_embeddings=131072,
        bos_token_id=163584,
        eos_token_id=163585,
    )


MODEL_PRESETS: dict[str, Any] = {"tiny": tiny_model, "k2": k2_model}
