"""The entry points a training loop calls: init, parallelize, and shard a batch.

    meshes = init_distributed(cfg.parallel, n_routed_experts=cfg.model.n_routed_experts)
    model = parallelize(model, cfg.parallel, meshes)          # EP, CP hooks, FSDP2
    loss = parallel_lm_loss(model, ids, labels, meshes)    # this rank's share of the mean
    loss.backward(); clip_grad_norm_(model.parameters(), c); optimizer.step()
    sync_expert_loads(model); model.update_router_biases()

Under `torchrun --nproc-per-node N` the process group comes from torchrun's environment;
without it (one process) `init_distributed` returns None and nothing is parallelized.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cadenza.config.parallel import ParallelConfig
from cadenza.parallel.context_parallel import KVGather, split_sequence
from cadenza.parallel.expert_parallel import apply_expert_parallel
from cadenza.parallel.fsdp import apply_fsdp, mixed_precision
from cadenza.parallel.grad import global_token_count
from cadenza.parallel.mesh import Meshes, build_meshes, check_layout


def init_distributed(cfg: ParallelConfig, n_routed_experts: int | None = None) -> Meshes | None:
    """Join torchrun's process group (gloo on CPU, nccl on GPU) and build both meshes.

    The layout is validated before the process group is joined. Returns None when running
    as a single process with a trivial layout.
    """
    if dist.is_initialized():
        world_size = dist.get_world_size()
    else:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    check_layout(world_size, cfg.dense, cfg.expert, n_routed_experts)
    if world_size == 1 and not dist.is_initialized():
        return None
    backend = cfg.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device_type = "cuda" if backend == "nccl" else "cpu"
    if not dist.is_initialized():
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.timeout_s))
    return build_meshes(
        dist.get_world_size(),
        cfg.dense,
        cfg.expert,
        n_routed_experts=n_routed_experts,
        device_type=device_type,
        print_groups=cfg.print_groups,
    )


def apply_context_parallel(model: nn.Module, cp_mesh) -> int:
    """Give every attention module (`model.layers[i].attn`) the K/V all-gather hook."""
    hook = KVGather(cp_mesh.get_group())
    n = 0
    for block in model.layers:
        attn = getattr(block, "attn", None)
        if attn is None or not hasattr(attn, "kv_gather"):
            raise ValueError(
                f"{type(block).__name__}: context parallelism needs an attention module at "
                "`.attn` with a `kv_gather` attribute (the K/V all-gather injection point)"
            )
        attn.kv_gather = hook
        n += 1
    return n


def parallelize(model: nn.Module, cfg: ParallelConfig, meshes: Meshes | None) -> nn.Module:
    """Apply expert parallelism, context parallelism and FSDP2 (in that order) in place."""
    if meshes is None:
        return model
    layout = meshes.layout
    if layout.ep > 1:
        apply_expert_parallel(model, meshes.expert["ep"])
    if layout.cp > 1:
        apply_context_parallel(model, meshes.dense["cp"])
    if layout.world_size > 1:
        apply_fsdp(
            model,
            meshes,
            mixed_precision(cfg.param_dtype, cfg.reduce_dtype),
            reshard_after_forward=cfg.reshard_after_forward,
        )
    return model


def shard_batch(
    input_ids: torch.Tensor, labels: torch.Tensor, meshes: Meshes | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's rows (split over dp = replicate x shard) and sequence part (over cp).

    `input_ids` and `labels` are the global batch [B, T], labels already shifted (label t is
    the target for input t). Returns (ids, labels, positions) with positions [1, T / cp]
    (the model's RoPE positions, shared by the rows).
    """
    b, t = input_ids.shape
    if meshes is None:
        return input_ids, labels, torch.arange(t)[None]
    layout = meshes.layout
    if b % layout.dp:
        raise ValueError(
            f"rule 'batch divisible by data-parallel degree': global batch {b} over "
            f"dp = replicate x shard = {layout.dp}; use a batch size that is a multiple of {layout.dp}"
        )
    rows = slice(
        meshes.dp.get_local_rank() * (b // layout.dp),
        (meshes.dp.get_local_rank() + 1) * (b // layout.dp),
    )
    ids, lab = input_ids[rows], labels[rows]
    cp_rank = meshes.dense.get_local_rank("cp")
    ids, positions = split_sequence(ids, cp_rank, layout.cp)
    lab, _ = split_sequence(lab, cp_rank, layout.cp)
    return ids, lab, positions[None]


def parallel_lm_loss(
    model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, meshes: Meshes | None
) -> torch.Tensor:
    """This rank's share of the global mean next-token loss (see grad.py for why).

    sum over this rank's tokens of CE / (tokens in the whole global batch); summing the
    shares over ranks gives the mean, and summing their gradients the mean's gradient.
    With meshes=None it is the plain mean on one process.
    """
    ids, lab, positions = shard_batch(input_ids, labels, meshes)
    out = model(ids, positions=positions)
    logits = getattr(out, "logits", out)
    n = global_token_count(lab.numel()) if meshes is not None else lab.numel()
    return F.cross_entropy(logits.float().flatten(0, 1), lab.flatten(), reduction="sum") / n


def sync_expert_loads(model: nn.Module, group=None) -> None:
    """Sum each MoE layer's `tokens_per_expert` over ranks (before the router-bias update).

    Every rank counts only the tokens it routed; the aux-loss-free balancing rule needs the
    global load, the same on all ranks, so all ranks make the same bias update.
    """
    loads = [m.tokens_per_expert for m in model.modules() if hasattr(m, "tokens_per_expert")]
    if not loads or not dist.is_initialized():
        return
    flat = torch.cat([x.reshape(-1) for x in loads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for x in loads:
        x.copy_(flat[offset : offset + x.numel()].view_as(x))
        offset += x.numel()


def sync_max_logits(model: nn.Module, group=None) -> None:
    """Max of each attention's recorded `max_logit` [H] over ranks (for QK-clip).

    Each rank sees only its own batch rows and sequence part; QK-clip must act on the
    global maximum, and identically on every rank holding a shard of the weights.
    """
    if not dist.is_initialized():
        return
    for m in model.modules():
        value = getattr(m, "max_logit", None)
        if isinstance(value, torch.Tensor):
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
