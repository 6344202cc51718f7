"""cadenza.model: the DeepSeek-V3 / Kimi K2 MoE model, Hugging Face I/O, KV cache, sampling."""

from cadenza.model.hf_io import (
    CheckpointError,
    config_from_hf,
    config_to_hf,
    from_pretrained,
    load_config,
    save_pretrained,
)
from cadenza.model.kv_cache import KVCache
from cadenza.model.sampler import Generation, Prefix, Scores, generate, prefill, sample_next, score
from cadenza.model.transformer import Block, CausalLM

__all__ = [
    "Block",
    "CausalLM",
    "CheckpointError",
    "Generation",
    "KVCache",
    "Prefix",
    "Scores",
    "generate",
    "prefill",
    "sample_next",
    "score",
    "config_from_hf",
    "config_to_hf",
    "from_pretrained",
    "load_config",
    "save_pretrained",
]
