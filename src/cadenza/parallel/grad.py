"""Gradient rules shared by both meshes: global-token normalization, sums, one global norm.

Normalization (one rule for dense and expert weights). With N the number of loss tokens in
the whole global batch (all ranks), each rank computes

    loss_r = sum over its own tokens of l_t / N

and every reduction of gradients is a plain SUM (FSDP reduce-scatter over the shard dims,
all-reduce over the replicate dims). Then sum_r grad(loss_r) = grad(mean over all tokens):
exactly the single-process gradient. With gradient accumulation, N counts the tokens of all
micro-batches of the step (sum the local counts first, then one `global_token_count`). A per-rank mean followed by FSDP's default averaging
would instead weight ranks with few tokens too much, and for experts (reduced over the
expert mesh, world / ep ranks) would come out ep times too large.

gloo has no PREMUL_SUM and FSDP2's custom divide factor would otherwise use it, so sums are
forced (`set_force_sum_reduction_for_comms`) with a divide factor of 1.

Clipping: torch's clip_grad_norm_ cannot mix DTensors from two meshes. Each mesh's squared
norm is computed from local shards and summed over that mesh's sharded dimensions only
(replicas hold the same values and are counted once); the global norm combines them:
||g|| = sqrt(sum over meshes of ||g_mesh||^2).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate


def global_token_count(local_count: int | torch.Tensor, group=None) -> int:
    """N: the number of loss tokens summed over all ranks of `group` (default: world)."""
    n = torch.as_tensor(local_count, dtype=torch.int64).reshape(1).clone()
    if dist.is_initialized():
        dist.all_reduce(n, group=group)
    return int(n.item())


def use_sum_reductions(model: nn.Module) -> int:
    """Make every FSDP2 module of `model` sum gradients (divide factor 1, force-sum comms)."""
    from torch.distributed.fsdp import FSDPModule

    n = 0
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
            n += 1
    return n


def _sharded_dims(t: DTensor) -> tuple[int, ...]:
    return tuple(i for i, p in enumerate(t.placements) if not isinstance(p, Replicate))


def grad_norms_by_mesh(params: Iterable[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Squared L2 norm of the gradients per mesh (key: the mesh's dim names), replicated."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    meshes: dict[tuple, object] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            mesh = g.device_mesh
            key = (mesh.mesh_dim_names, tuple(mesh.shape), _sharded_dims(g))
            meshes.setdefault(key, mesh)
            groups.setdefault(key, []).append(g.to_local())
        else:
            groups.setdefault(("local",), []).append(g)
    out: dict[str, torch.Tensor] = {}
    for key, grads in groups.items():
        sq = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum()
        if key != ("local",):
            mesh = meshes[key]
            for d in key[2]:
                dist.all_reduce(sq, group=mesh.get_group(d))
            name = "x".join(key[0] or ("mesh",))
        else:
            name = "local"
        out[name] = out[name] + sq if name in out else sq
    return out


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale gradients so their global L2 norm is at most `max_norm`; return the norm before.

    Works across any mix of meshes (dense and expert) and plain tensors.
    """
    params = [p for p in params if p.grad is not None]
    norms = list(grad_norms_by_mesh(params).values())
    # Sum on the gradients' device (CPU under gloo, the GPU under NCCL).
    total = torch.sqrt(torch.stack(norms).sum()) if norms else torch.zeros(())
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        g.mul_(coef.to(g.dtype))
    return total
