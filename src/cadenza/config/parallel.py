"""Parallel layout of a training job: the two meshes, precision, launch settings.

Degrees follow cadenza.parallel.mesh: the dense mesh is replicate x shard x cp and the expert
mesh expert_replicate x expert_shard x ep, each equal to the world size (-1: the rest).
All 1 with shard=-1 is plain FSDP over however many ranks torchrun starts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ParallelConfig:
    replicate: int = 1  # dense HSDP replicas
    shard: int = -1  # dense FSDP shard degree (cp is folded into it for the weights)
    cp: int = 1  # context parallel: ranks splitting each sequence
    expert_replicate: int = 1
    expert_shard: int = -1
    ep: int = 1  # expert parallel: ranks splitting the routed experts
    backend: str = "auto"  # "auto" (nccl on GPU, gloo on CPU), "gloo", "nccl"
    param_dtype: str = "float32"  # FSDP compute dtype ("bfloat16" for mixed precision)
    reduce_dtype: str = "float32"  # gradient reduction dtype
    reshard_after_forward: bool = True
    timeout_s: float = 600.0  # a rank stuck in a collective fails after this (no endless hang)
    print_groups: bool = False  # rank 0 prints the rank groups of both meshes

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(
                f"parallel.backend: expected auto, gloo or nccl, found {self.backend!r}"
            )
        if self.timeout_s <= 0:
            raise ValueError(f"parallel.timeout_s: expected > 0, found {self.timeout_s}")

    @property
    def dense(self) -> dict[str, int]:
        return dict(replicate=self.replicate, shard=self.shard, cp=self.cp)

    @property
    def expert(self) -> dict[str, int]:
        return dict(replicate=self.expert_replicate, shard=self.expert_shard, ep=self.ep)
