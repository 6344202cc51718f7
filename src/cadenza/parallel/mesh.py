"""Two device meshes over the same ranks: one for dense weights, one for routed experts.

The dense mesh factors the world as (dp_replicate, dp_shard, cp) and the expert mesh as
(edp_replicate, edp_shard, ep). Both are cut from one 1-D world mesh, so they are independent
factorizations of the same ranks: CP=2 and EP=8 fit on 8 ranks (a single shared mesh would
need CP x EP = 16). Ranks are laid out row-major with the last dimension innermost, so cp
and ep groups are runs of adjacent ranks (on GPUs, the fast intra-node links).

Layouts are checked by `check_layout` before any process group is created; every error
names the rule it breaks. `rank_groups` gives the groups as plain lists without touching
torch.distributed (the mesh-traffic benchmark and `print_groups` use it).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

DENSE_DIMS = ("dp_replicate", "dp_shard", "cp")
EXPERT_DIMS = ("edp_replicate", "edp_shard", "ep")


class LayoutError(ValueError):
    """A mesh layout that cannot be built; the message names the violated rule."""


@dataclass(frozen=True)
class Layout:
    """Degrees of both meshes, all resolved (no -1)."""

    world_size: int
    replicate: int
    shard: int
    cp: int
    expert_replicate: int
    expert_shard: int
    ep: int

    @property
    def dense_shape(self) -> tuple[int, int, int]:
        return (self.replicate, self.shard, self.cp)

    @property
    def expert_shape(self) -> tuple[int, int, int]:
        return (self.expert_replicate, self.expert_shard, self.ep)

    @property
    def dp(self) -> int:
        """Data-parallel degree: number of distinct batch shards (cp ranks share one)."""
        return self.replicate * self.shard


def _resolve(name: str, spec: dict, keys: tuple[str, str, str], world_size: int) -> list[int]:
    if not isinstance(spec, dict):
        raise LayoutError(f"{name} mesh: expected a dict with keys {keys}, found {spec!r}")
    unknown = sorted(set(spec) - set(keys))
    if unknown:
        raise LayoutError(
            f"{name} mesh: unknown key(s) {unknown}; expected some of {list(keys)} "
            f"(e.g. {name}=dict({keys[0]}=1, {keys[1]}=-1, {keys[2]}=1))"
        )
    sizes = [spec.get(k, -1 if k == "shard" else 1) for k in keys]
    for k, v in zip(keys, sizes):
        if isinstance(v, bool) or not isinstance(v, int) or (v < 1 and v != -1):
            raise LayoutError(
                f"rule 'degrees are positive integers': {name}.{k}={v!r}; use an int >= 1 "
                "(or -1 on one dimension to take the rest of the world)"
            )
    inferred = [k for k, v in zip(keys, sizes) if v == -1]
    if len(inferred) > 1:
        raise LayoutError(
            f"rule 'at most one inferred (-1) degree per mesh': {name} has {inferred} set to -1"
        )
    if inferred:
        known = math.prod(v for v in sizes if v != -1)
        if world_size % known:
            raise LayoutError(
                f"rule '{name}: {' x '.join(keys)} = world size': the fixed degrees multiply to "
                f"{known}, which does not divide world size {world_size}"
            )
        sizes[sizes.index(-1)] = world_size // known
    if math.prod(sizes) != world_size:
        desc = " x ".join(f"{k}={v}" for k, v in zip(keys, sizes))
        raise LayoutError(
            f"rule '{name}: {' x '.join(keys)} = world size': {desc} = {math.prod(sizes)}, "
            f"but the world has {world_size} ranks; change the degrees so their product is "
            f"{world_size}"
        )
    return sizes


def check_layout(
    world_size: int,
    dense: dict | None = None,
    expert: dict | None = None,
    n_routed_experts: int | None = None,
) -> Layout:
    """Validate and resolve a dual-mesh layout; pure (no torch.distributed).

    dense = dict(replicate, shard, cp), expert = dict(replicate, shard, ep); a missing key is 1
    except `shard`, which defaults to -1 (the rest of the world).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise LayoutError(f"rule 'world size >= 1': found {world_size!r}")
    r, s, cp = _resolve("dense", dense or {}, ("replicate", "shard", "cp"), world_size)
    er, es, ep = _resolve("expert", expert or {}, ("replicate", "shard", "ep"), world_size)
    if n_routed_experts is not None:
        if n_routed_experts % ep:
            raise LayoutError(
                f"rule 'n_routed_experts divisible by ep': {n_routed_experts} experts cannot be "
                f"split evenly over ep={ep} ranks; pick ep from the divisors of {n_routed_experts}"
            )
    return Layout(world_size, r, s, cp, er, es, ep)


def rank_groups(shape: tuple[int, ...], names: tuple[str, ...]) -> dict[str, list[list[int]]]:
    """For each mesh dimension, the rank groups that communicate along it (row-major ranks)."""
    world = math.prod(shape)
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    out: dict[str, list[list[int]]] = {}
    for d, name in enumerate(names):
        groups = []
        for r in range(world):
            if (r // strides[d]) % shape[d] == 0:
                groups.append([r + k * strides[d] for k in range(shape[d])])
        out[name] = groups
    return out


def describe(layout: Layout) -> str:
    """Human-readable rank groups of both meshes."""
    lines = [f"world: {layout.world_size} ranks"]
    for title, shape, names in (
        ("dense mesh", layout.dense_shape, DENSE_DIMS),
        ("expert mesh", layout.expert_shape, EXPERT_DIMS),
    ):
        lines.append(f"{title} {dict(zip(names, shape))}:")
        for name, groups in rank_groups(shape, names).items():
            lines.append(f"  {name:<14} {groups}")
    return "\n".join(lines)


@dataclass(frozen=True)
class Meshes:
    """The two meshes; unpacks as `dense, expert = build_meshes(...)`."""

    dense: Any  # DeviceMesh (dp_replicate, dp_shard, cp)
    expert: Any  # DeviceMesh (edp_replicate, edp_shard, ep)
    layout: Layout
    dense_fsdp: Any = None  # (dp_replicate, dp_shard_cp): FSDP shards dense weights over shard x cp
    expert_fsdp: Any = None  # (edp_replicate, edp_shard): FSDP of each rank's local experts
    dp: Any = None  # 1-D, replicate x shard: ranks holding different batch shards

    def __iter__(self) -> Iterator[Any]:
        return iter((self.dense, self.expert))


def build_meshes(
    world_size: int,
    dense: dict | None = None,
    expert: dict | None = None,
    n_routed_experts: int | None = None,
    device_type: str = "cpu",
    print_groups: bool = False,
) -> Meshes:
    """Build the dense and expert DeviceMeshes from one world mesh (collective on all ranks).

    The layout is validated first, on every rank, before any process group exists, so a bad
    layout fails the same way everywhere instead of hanging in a collective. Flattened views
    are registered for FSDP and data loading: dense["dp_shard_cp"] (FSDP shards dense weights
    over shard x cp), dense["dp"] (the batch split), expert["edp"] (replicate x shard).
    """
    layout = check_layout(world_size, dense, expert, n_routed_experts)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise LayoutError(
            "rule 'process group first': torch.distributed is not initialized; call "
            "cadenza.parallel.init_distributed() (or run under torchrun) before build_meshes"
        )
    if dist.get_world_size() != world_size:
        raise LayoutError(
            f"rule 'layout matches the job': layout is for {world_size} ranks, but the process "
            f"group has {dist.get_world_size()}; launch with --nproc-per-node {world_size} or "
            "change the degrees"
        )
    if print_groups and dist.get_rank() == 0:
        print(describe(layout), flush=True)
    world = init_device_mesh(device_type, (world_size,), mesh_dim_names=("world",))
    dense_mesh = world._unflatten(0, layout.dense_shape, DENSE_DIMS)
    expert_mesh = world._unflatten(0, layout.expert_shape, EXPERT_DIMS)
    # cp is innermost, so (shard, cp) flattened is a contiguous run: unflatten the world again.
    dense_fsdp = world._unflatten(
        0, (layout.replicate, layout.shard * layout.cp), ("dp_replicate", "dp_shard_cp")
    )
    expert_fsdp = expert_mesh["edp_replicate", "edp_shard"]
    dp = dense_mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return Meshes(dense_mesh, expert_mesh, layout, dense_fsdp, expert_fsdp, dp)
