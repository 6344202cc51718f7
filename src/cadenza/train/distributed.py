"""The pretraining job's distributed side: what changes when `cadenza train` runs under torchrun.

    torchrun --nproc-per-node 4 -m cadenza.cli.main train \\
        parallel.shard=2 parallel.cp=2 parallel.ep=4 parallel.expert_shard=1

Every rank builds the same full model from the same seed, then `cadenza.parallel` shards it
(dense weights on the dense mesh, experts on the expert mesh), so step 0 equals the
single-process job's. Each step every rank takes the same global batch and keeps its part
(`shard_batch`: rows over dp, sequence over cp); its loss is its share of the global mean,

    loss_r = sum over rank r's tokens of CE / N,   N = tokens of the whole global batch,

so sum_r loss_r is the single-process loss and summed gradients its gradient. Scalars a
decision depends on (the loss, a stop signal, expert loads, max logits) are reduced over all
ranks, so every rank takes the same branch. Rank 0 alone writes logs, metrics and files.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from cadenza.config import Config
from cadenza.config.model import ModelConfig
from cadenza.parallel import (
    Meshes,
    clip_grad_norm_,
    init_distributed,
    parallel_lm_loss,
    parallelize,
    sync_expert_loads,
    sync_max_logits,
)


class LayoutMismatch(ValueError):
    """The batch does not split over the layout (the message says what to change)."""


@dataclass
class ParallelJob:
    """This process's place in a distributed run; None stands for a single process."""

    meshes: Meshes
    rank: int
    world_size: int
    local_world_size: int
    owns_group: bool  # we joined the process group, so we leave it

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        """Where this rank computes: its GPU under NCCL (init_distributed picked it), else CPU."""
        if self.meshes.dense.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()

    # ---- the step --------------------------------------------------------------------

    def parallelize(self, model: nn.Module, cfg: Config) -> nn.Module:
        return parallelize(model.to(self.device), cfg.parallel, self.meshes)

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This rank's share of the global mean next-token loss (summed over ranks: the mean)."""
        d = self.device
        return parallel_lm_loss(model, inputs.to(d), targets.to(d), self.meshes)

    def total(self, value: torch.Tensor | float) -> float:
        """Sum of a scalar over all ranks."""
        t = torch.as_tensor(value).detach().to(self.device, torch.float64).reshape(1).clone()
        dist.all_reduce(t)
        return t.item()

    def stop_signal(self, signum: int | None) -> int | None:
        """The signal any rank received (ranks may see it at different steps), or None."""
        t = torch.tensor([signum or 0], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item()) or None

    def clip_grad_norm_(self, params, max_norm: float) -> float:
        return clip_grad_norm_(params, max_norm).item()

    def sync_model_stats(self, model: nn.Module) -> None:
        """Global expert loads (router-bias update) and max logits (QK-clip) on every rank."""
        sync_expert_loads(model)
        sync_max_logits(model)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        was_training = model.training
        model.eval()
        try:
            shares = [self.loss(model, x, y) for x, y in batches]
        finally:
            model.train(was_training)
        return self.total(torch.stack(shares).sum()) / len(batches)

    # ---- the whole model, for the Hugging Face checkpoint and the sample ----------------

    def full_model(self, model: nn.Module, model_cfg: ModelConfig) -> nn.Module | None:
        """A plain CausalLM with the sharded model's weights on rank 0 (None elsewhere).

        Collective: every rank sends its shards; rank 0 assembles them on the CPU.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from cadenza.model import CausalLM

        # gathering the FSDP x EP-sharded experts takes two all-gathers, and torch warns so
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        full = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if not self.is_main:
            return None
        plain = CausalLM(model_cfg)
        plain.load_state_dict(full, strict=True)  # router biases too (identical on all ranks)
        return plain.eval()


def check_batch_layout(cfg: Config, job: ParallelJob) -> None:
    """The global batch splits over dp ranks and each sequence over 2 x cp chunks."""
    layout = job.meshes.layout
    if cfg.data.batch_size % layout.dp:
        raise LayoutMismatch(
            f"data.batch_size={cfg.data.batch_size} (the global batch) must be divisible by the "
            f"data-parallel degree dp = replicate x shard = {layout.dp}; use "
            f"data.batch_size={max(layout.dp, cfg.data.batch_size // layout.dp * layout.dp)}"
        )
    if cfg.data.seq_len % (2 * layout.cp):
        raise LayoutMismatch(
            f"data.seq_len={cfg.data.seq_len} must be divisible by 2 x cp = {2 * layout.cp} "
            "(context parallelism cuts each sequence into 2 x cp chunks); change data.seq_len "
            "or parallel.cp"
        )


def start(cfg: Config) -> ParallelJob | None:
    """Join the process group torchrun set up (or the caller's) and build the meshes.

    Returns None for a single process with no process group: the single-process job.
    """
    owns = not dist.is_initialized()
    meshes = init_distributed(cfg.parallel, n_routed_experts=cfg.model.n_routed_experts)
    if meshes is None:
        return None
    world = dist.get_world_size()
    job = ParallelJob(
        meshes=meshes,
        rank=dist.get_rank(),
        world_size=world,
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
        owns_group=owns,
    )
    try:
        check_batch_layout(cfg, job)
    except LayoutMismatch:
        job.close()
        raise
    return job
