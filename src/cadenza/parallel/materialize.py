"""Initialize a model built on the meta device after it was parallelized.

A K2-sized model does not fit on one rank, so it is built on `meta`, parallelized (shapes
only), allocated with `to_empty`, and then each rank initializes only its own shards. Two
rules make the result a valid initialization of the whole model:

- different shards get different values: every rank draws from its own generator
  (seed, rank) into its local shards. (Calling `init_weights` on the DTensors directly
  gives every rank the same numbers on CPU in torch 2.13, whatever the generator: the
  experts of one ep rank would be copies of another's. So the model's init runs on plain
  local views of the shards.)
- replicas agree: along every mesh dimension where a parameter is Replicate (HSDP's
  replicate dims), the coordinate-0 rank's values are broadcast.

The values differ from a one-process initialization with the same seed (they are drawn in
another order) but follow the same distributions, as `model.init_weights` defines them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate


def init_sharded_weights(
    model: nn.Module, seed: int = 0, device: str | torch.device = "cpu"
) -> None:
    """Allocate a meta-device parallelized `model` on `device` and initialize its shards.

    The model must provide `init_weights(generator=None)` (cadenza.model.CausalLM does).
    """
    init = getattr(model, "init_weights", None)
    if not callable(init):
        raise TypeError(
            f"{type(model).__name__}: expected an `init_weights(generator=None)` method to "
            "initialize the shards after `to_empty`"
        )
    model.to_empty(device=device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    rank = dist.get_rank() if dist.is_initialized() else 0
    generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + rank)
    with local_shards(model):
        init(generator=generator)
    if dist.is_initialized():
        broadcast_replicas(model)


@contextlib.contextmanager
def local_shards(model: nn.Module) -> Iterator[None]:
    """Temporarily replace every DTensor parameter by a plain view of its local shard.

    In-place writes (initialization) go straight into the shards; names are unchanged.
    """
    swapped = []
    with torch.no_grad():
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if isinstance(p, DTensor):
                    swapped.append((module, name, p))
                    module._parameters[name] = nn.Parameter(p.to_local(), requires_grad=False)
    try:
        yield
    finally:
        for module, name, p in swapped:
            module._parameters[name] = p


@torch.no_grad()
def broadcast_replicas(model: nn.Module) -> None:
    """Make replicas of every DTensor parameter equal to the coordinate-0 replica."""
    for p in model.parameters():
        if not isinstance(p, DTensor):
            continue
        mesh = p.device_mesh
        for dim, placement in enumerate(p.placements):
            if isinstance(placement, Replicate) and mesh.size(dim) > 1:
                dist.broadcast(p.to_local(), group=mesh.get_group(dim), group_src=0)
