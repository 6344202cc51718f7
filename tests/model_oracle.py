"""Random tiny DeepSeek-V3 models built with transformers, the oracle of the model tests."""

from __future__ import annotations

import torch

CONFIGS = {
    # no q_lora, 3 groups keep 2, YaRN with mscale != mscale_all_dim, odd dims
    "noqlora-groups-yarn": dict(
        vocab_size=97,
        hidden_size=40,
        intermediate_size=56,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=3,
        n_routed_experts=6,
        n_group=3,
        topk_group=2,
        num_experts_per_tok=3,
        first_k_dense_replace=1,
        q_lora_rank=None,
        kv_lora_rank=12,
        qk_rope_head_dim=6,
        qk_nope_head_dim=10,
        v_head_dim=14,
        routed_scaling_factor=1.7,
        norm_topk_prob=True,
        max_position_embeddings=256,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=5000.0,
            factor=4.0,
            original_max_position_embeddings=64,
            beta_fast=32,
            beta_slow=1,
            mscale=0.7,
            mscale_all_dim=1.0,
        ),
    ),
    # q_lora, one group, plain RoPE without interleave, unnormalized weights, 2 shared experts
    "qlora-plainrope": dict(
        vocab_size=101,
        hidden_size=36,
        intermediate_size=44,
        moe_intermediate_size=20,
        num_hidden_layers=2,
        num_attention_heads=2,
        n_routed_experts=5,
        n_shared_experts=2,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        q_lora_rank=18,
        kv_lora_rank=14,
        qk_rope_head_dim=4,
        qk_nope_head_dim=6,
        v_head_dim=10,
        routed_scaling_factor=2.5,
        norm_topk_prob=False,
        rope_interleave=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    ),
    # K2-like: all layers MoE, 4 groups keep 2, DeepSeek YaRN (mscale == mscale_all_dim),
    # attention biases, tied embeddings
    "qlora-4groups-k2yarn": dict(
        vocab_size=83,
        hidden_size=30,
        intermediate_size=40,
        moe_intermediate_size=14,
        num_hidden_layers=2,
        num_attention_heads=5,
        n_routed_experts=12,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=4,
        first_k_dense_replace=0,
        q_lora_rank=22,
        kv_lora_rank=10,
        qk_rope_head_dim=8,
        qk_nope_head_dim=6,
        v_head_dim=6,
        routed_scaling_factor=2.827,
        norm_topk_prob=True,
        attention_bias=True,
        tie_word_embeddings=True,
        max_position_embeddings=512,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=50000.0,
            factor=8.0,
            original_max_position_embeddings=64,
            beta_fast=1.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ),
}


def hf_model(name: str, seed: int = 0, **overrides):
    """A transformers DeepseekV3ForCausalLM (fp32, eager kernels) with random weights large
    enough that routing differs per token, and distinct nonzero correction biases."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    kw = dict(CONFIGS[name], **overrides)
    kw.setdefault("num_key_value_heads", kw["num_attention_heads"])
    cfg = DeepseekV3Config(
        **kw, num_mtp_layers=0, attn_implementation="eager", experts_implementation="eager"
    )
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.25)
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                b = m.e_score_correction_bias
                b.copy_(torch.randperm(b.numel()).float() * 0.03 - 0.1)
    return model
