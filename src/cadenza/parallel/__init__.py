"""cadenza.parallel: dual-mesh HSDP with expert and context parallelism, applied from outside.

meshes = init_distributed(cfg.parallel, n_routed_experts=...)  # or build_meshes(...)
model = parallelize(model, cfg.parallel, meshes)
"""

from cadenza.parallel.grad import clip_grad_norm_, global_token_count
from cadenza.parallel.materialize import init_sharded_weights
from cadenza.parallel.mesh import LayoutError, Meshes, build_meshes, check_layout, describe
from cadenza.parallel.parallelize import (
    init_distributed,
    parallel_lm_loss,
    parallelize,
    shard_batch,
    sync_expert_loads,
    sync_max_logits,
)

__all__ = [
    "LayoutError",
    "Meshes",
    "build_meshes",
    "check_layout",
    "clip_grad_norm_",
    "describe",
    "global_token_count",
    "init_distributed",
    "init_sharded_weights",
    "parallel_lm_loss",
    "parallelize",
    "shard_batch",
    "sync_expert_loads",
    "sync_max_logits",
]
