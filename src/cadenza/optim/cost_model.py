"""A cost model of one sharded-Muon optimizer step: Newton-Schulz FLOPs, bytes moved, and
the time they take at stated compute and link rates, with communication overlapped with
compute across pipelined buckets.

Dense (non-expert) parameters are sharded FSDP-style on rows over a dense shard group;
routed experts are split over an expert-parallel group on the expert dimension (whole
experts per rank: no bytes move for them) and, when the expert group is wider than the
number of experts, row-sharded within each expert over the remaining ranks. Replica groups
(HSDP) repeat the same work in parallel and do not change the step time.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

from cadenza.model.units import Units
from cadenza.optim.shard_plan import ShardSpec, make_plan


@dataclass
class Hardware:
    """Defaults: an H100 SXM node (8 GPUs on NVLink) and 400 Gb/s InfiniBand per GPU."""

    name: str = "H100"
    peak_flops: float = 989e12  # dense bf16 tensor-core FLOP/s
    ns_efficiency: float = 0.5  # fraction of peak batched Newton-Schulz reaches
    gpus_per_node: int = 8
    intra_node_bw: float = 450e9  # bytes/s per GPU, one direction (NVLink)
    inter_node_bw: float = 50e9  # bytes/s per GPU, one direction (400 Gb/s)
    latency_s: float = 20e-6  # per collective


@dataclass
class GroupCost:
    ranks: int
    flops_max: float  # NS FLOPs on the busiest rank
    flops_mean: float
    bytes_max: float  # bytes sent by the busiest rank
    buckets: int
    lower_bound_bytes: float = 0.0
    total_bytes: float = 0.0


@dataclass
class StepCost:
    gpus: int
    compute_s: float
    comm_s: float
    exposed_s: float  # the part that does not overlap (pipeline fill and drain)
    total_s: float
    dominant: str
    groups: dict[str, GroupCost] = field(default_factory=dict)


@functools.lru_cache(maxsize=64)
def _plan_group(
    params: tuple[tuple[tuple[int, ...], Units], ...],
    world: int,
    shard_dim: int,
    elem_bytes: int,
    bucket_numel: int,
    ns_steps: int,
) -> GroupCost:
    """Plan a group whose parameters are all sharded on `shard_dim` over `world` ranks
    (cached: the scans re-plan the same groups for many GPU counts)."""
    if not params or world < 1:
        return GroupCost(world, 0.0, 0.0, 0.0, 0)
    shapes = [s for s, _ in params]
    units = [u for _, u in params]
    specs = [[[ShardSpec(shard_dim, world, r)] for r in range(world)] for _ in shapes]
    plan = make_plan(shapes, units, specs, world, bucket_numel=bucket_numel, ns_steps=ns_steps)
    flops = plan.flops_per_rank()
    sent = plan.bytes_per_rank(elem_bytes)
    return GroupCost(
        ranks=world,
        flops_max=max(flops),
        flops_mean=sum(flops) / world,
        bytes_max=max(sent),
        buckets=len(plan.buckets),
        lower_bound_bytes=plan.lower_bound_bytes(elem_bytes),
        total_bytes=sum(sent),
    )


def _link_bw(ranks: int, hw: Hardware) -> float:
    return hw.intra_node_bw if ranks <= hw.gpus_per_node else hw.inter_node_bw


def predict_step(
    params: Sequence[tuple[tuple[int, ...], Units]],
    gpus: int,
    hw: Hardware | None = None,
    dense_shard: int | None = None,
    ep: int | None = None,
    elem_bytes: int = 2,
    bucket_numel: int = 1 << 25,
    ns_steps: int = 5,
) -> StepCost:
    """Predict one Muon step for a model given as its Muon parameters [(shape, units)].

    dense_shard: ranks in a dense FSDP shard group (default: min(gpus, gpus_per_node)).
    ep: expert-parallel degree (default: the largest divisor of gpus that divides the expert
    count); the remaining gpus // ep ranks row-shard each expert.
    """
    hw = hw or Hardware()
    dense_shard = dense_shard or min(gpus, hw.gpus_per_node)
    if gpus % dense_shard:
        raise ValueError(f"dense_shard={dense_shard} must divide gpus={gpus}")
    n_experts = max((s[0] for s, u in params if u.kind == "experts"), default=0)
    if n_experts and ep is None:
        ep = max(d for d in range(1, gpus + 1) if gpus % d == 0 and n_experts % d == 0)
    ep = ep or 1
    if gpus % ep:
        raise ValueError(f"ep={ep} must divide gpus={gpus}")
    inner = gpus // ep  # ranks sharing one expert's rows
    dense = [(tuple(s), u) for s, u in params if u.kind not in ("experts", "adamw")]
    # One expert-parallel rank's local experts, row-sharded over `inner` ranks.
    local = [((s[0] // ep,) + tuple(s[1:]), u) for s, u in params if u.kind == "experts"]
    dense_cost = _plan_group(tuple(dense), dense_shard, 0, elem_bytes, bucket_numel, ns_steps)
    expert_cost = _plan_group(tuple(local), inner, 1, elem_bytes, bucket_numel, ns_steps)
    rate = hw.peak_flops * hw.ns_efficiency
    # Dense and expert work run one after the other on each GPU.
    compute = (dense_cost.flops_max + expert_cost.flops_max) / rate
    comm = dense_cost.bytes_max / _link_bw(dense_shard, hw) + expert_cost.bytes_max / _link_bw(
        inner, hw
    )
    n_buckets = dense_cost.buckets + expert_cost.buckets
    comm += hw.latency_s * 2 * n_buckets
    # Pipelined buckets: the longer stream sets the pace; one bucket of the shorter one is
    # exposed at the start (first gather) and end (last return).
    exposed = min(compute, comm) / max(n_buckets, 1) * 2 if comm > 0 else 0.0
    total = max(compute, comm) + exposed
    return StepCost(
        gpus=gpus,
        compute_s=compute,
        comm_s=comm,
        exposed_s=exposed,
        total_s=total,
        dominant="compute" if compute >= comm else "communication",
        groups={"dense": dense_cost, "expert": expert_cost},
    )


def best_layout(params, gpus: int, hw: Hardware | None = None, dense_shard=None, **kw) -> StepCost:
    """The fastest predicted step over dense shard-group sizes (powers of two from one node up
    to 256 ranks, or the given one): wider dense groups split the dense units further but send
    over slower links."""
    hw = hw or Hardware()
    if dense_shard:
        return predict_step(params, gpus, hw, dense_shard=dense_shard, **kw)
    options = [d for d in (2**i for i in range(0, 9)) if d <= gpus and gpus % d == 0]
    options = [d for d in options if d >= min(gpus, hw.gpus_per_node)] or [gpus]
    return min(
        (predict_step(params, gpus, hw, dense_shard=d, **kw) for d in options),
        key=lambda c: c.total_s,
    )


def gpus_for_target(
    params,
    target_s: float,
    hw: Hardware | None = None,
    candidates: Sequence[int] | None = None,
    **kw,
) -> tuple[int | None, list[StepCost]]:
    """Smallest GPU count among `candidates` whose best predicted step time is <= target_s."""
    candidates = candidates or [8 * 2**i for i in range(0, 10)]
    results = []
    for n in candidates:
        c = best_layout(params, n, hw, **kw)
        results.append(c)
        if c.total_s <= target_s:
            return n, results
    return None, results


def describe(c: StepCost) -> str:
    d, e = c.groups["dense"], c.groups["expert"]
    return (
        f"{c.gpus:5d} GPUs: step {c.total_s * 1e3:8.1f} ms = max(compute {c.compute_s * 1e3:.1f}, "
        f"comm {c.comm_s * 1e3:.1f}) + exposed {c.exposed_s * 1e3:.1f} ms; dominant {c.dominant}; "
        f"dense group {d.ranks} ranks ({d.bytes_max / 1e6:.1f} MB sent/rank), "
        f"expert row group {e.ranks} ranks ({e.bytes_max / 1e6:.1f} MB sent/rank)"
    )


__all__ = [
    "GroupCost",
    "Hardware",
    "StepCost",
    "best_layout",
    "describe",
    "gpus_for_target",
    "predict_step",
]
