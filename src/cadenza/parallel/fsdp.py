"""FSDP2 applied to a plain model from outside, on two meshes.

- Routed experts (each MoE layer's `mlp.experts`): on the expert mesh. With ep > 1 they are
  first made expert-parallel (DTensor Shard(0) on ep, see expert_parallel.py); FSDP then
  shards each rank's local experts over edp_shard and replicates over edp_replicate.
- Everything else (attention, dense MLPs, router, shared experts, norms, embeddings, head):
  on the dense mesh, HSDP over (dp_replicate, dp_shard x cp). cp ranks hold different
  tokens of the same sequences, so for the weights they are just more data-parallel ranks:
  folding cp into the shard dimension shards dense weights over shard x cp ranks.

One FSDP unit per transformer block (its experts a separate unit on the other mesh), plus the
root for the embeddings and head. Gradients are summed, never averaged (grad.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from cadenza.parallel.grad import use_sum_reductions

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def mixed_precision(param_dtype: str = "float32", reduce_dtype: str = "float32"):
    """FSDP2 policy: compute in `param_dtype`, reduce gradients in `reduce_dtype`."""
    for name in (param_dtype, reduce_dtype):
        if name not in DTYPES:
            raise ValueError(f"dtype {name!r}: expected one of {sorted(DTYPES)}")
    return MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])


def _fsdp_mesh(mesh2d):
    """HSDP when the replicate dimension is > 1, plain FSDP on the shard dimension otherwise."""
    return mesh2d if mesh2d.shape[0] > 1 else mesh2d[mesh2d.mesh_dim_names[1]]


def apply_fsdp(
    model: nn.Module,
    meshes,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard `model` in place: experts on the expert mesh, the rest on the dense mesh."""
    dense_mesh = _fsdp_mesh(meshes.dense_fsdp)
    expert_mesh = _fsdp_mesh(meshes.expert_fsdp)
    mp = mp_policy or MixedPrecisionPolicy()
    for block in model.layers:
        experts = getattr(getattr(block, "mlp", None), "experts", None)
        if isinstance(experts, nn.Module):
            fully_shard(
                experts, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward
            )
        fully_shard(
            block, mesh=dense_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward
        )
    fully_shard(model, mesh=dense_mesh, mp_policy=mp, reshard_after_forward=False)
    use_sum_reductions(model)
    return model
