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


def _plan_group(
    params: Sequence[tuple[tuple[int, ...], Units]],
    world: int,
    specs_for,
    elem_bytes: int,
    bucket_numel: int,
    ns_steps: int,
    repeat: int = 1,
) -> GroupCost:
    if not params or world < 1:
        return GroupCost(world, 0.0, 0.0, 0.0, 0)
    shapes = [s for s, _ in params]
    units = [u for _, u in params]
    specs = [[specs_for(s, r) for r in range(world)] for s in shapes]
    plan = make_plan(shapes, units, specs, world, bucket_numel=bucket_numel, ns_steps=ns_steps)
    flops = plan.flops_per_rank()
    sent = [plan.bytes_sent(r, elem_bytes) for r in range(world)]
    return GroupCost(
        ranks=world,
        flops_max=max(flops) * repeat,
        flops_mean=sum(flops) / world * repeat,
        bytes_max=max(sent) * repeat,
        buckets=len(plan.buckets) * repeat,
        lower_bound_bytes=plan.lower_bound_bytes(elem_bytes) * repeat,
        total_bytes=sum(sent) * repeat,
    )


def _link_bw(ranks: int, hw: Hardware) -> float:
    return hw.intra_node_bw if ranks <= hw.gpus_per_node else hw.inter_node_bw


def predict_step(
    layers: Sequence[tuple[int, Sequence[tuple[tuple[int, ...], Units]]]],
    gpus: int,
    hw: Hardware | None = None,
    dense_shard: int | None = None,
    ep: int | None = None,
    elem_bytes: int = 2,
    bucket_numel: int = 1 << 25,
    ns_steps: int = 5,
) -> StepCost:
    """Predict one Muon step for a model given as [(count, params_of_one_such_layer), ...].

    Identical layers are planned once and counted `count` times (their buckets are distinct).
    dense_shard: ranks in a dense FSDP shard group (default: min(gpus, gpus_per_node)).
    ep: expert-parallel degree (default: the largest divisor of gpus that divides the expert
    count); the remaining gpus // ep ranks row-shard each expert.
    """
    hw = hw or Hardware()
    dense_shard = dense_shard or min(gpus, hw.gpus_per_node)
    if gpus % dense_shard:
        raise ValueError(f"dense_shard={dense_shard} must divide gpus={gpus}")
    n_experts = max((s[0] for _, ps in layers for s, u in ps if u.kind == "experts"), default=0)
    if n_experts and ep is None:
        ep = max(d for d in range(1, gpus + 1) if gpus % d == 0 and n_experts % d == 0)
    ep = ep or 1
    if gpus % ep:
        raise ValueError(f"ep={ep} must divide gpus={gpus}")
    inner = gpus // ep  # ranks sharing one expert's rows

    dense_cost = GroupCost(dense_shard, 0, 0, 0, 0)
    expert_cost = GroupCost(inner, 0, 0, 0, 0)
    for count, params in layers:
        dense = [(s, u) for s, u in params if u.kind not in ("experts", "adamw")]
        experts = [(s, u) for s, u in params if u.kind == "experts"]
        d = _plan_group(
            dense,
            dense_shard,
            lambda s, r: [ShardSpec(0, dense_shard, r)],
            elem_bytes,
            bucket_numel,
            ns_steps,
            count,
        )
        # One expert-parallel rank's local experts, row-sharded over `inner` ranks.
        local = [((s[0] // ep,) + tuple(s[1:]), u) for s, u in experts]
        e = _plan_group(
            local,
            inner,
            lambda s, r: [ShardSpec(1, inner, r)],
            elem_bytes,
            bucket_numel,
            ns_steps,
            count,
        )
        for acc, g in ((dense_cost, d), (expert_cost, e)):
            acc.flops_max += g.flops_max
            acc.flops_mean += g.flops_mean
            acc.bytes_max += g.bytes_max
            acc.buckets += g.buckets
            acc.lower_bound_bytes += g.lower_bound_bytes
            acc.total_bytes += g.total_bytes
    rate = hw.peak_flops * hw.ns_efficiency
    # Dense and expert work run one after the other on each GPU.
    compute = (dense_cost.flops_max + expert_cost.flops_max) / rate
    comm = dense_cost.bytes_max / _link_bw(dense_shard, hw) + expert_cost.bytes_max / _link_bw(
        inner, hw
    )
    buckets = max(dense_cost.buckets + expert_cost.buckets, 1)
    comm += hw.latency_s * 2 * (dense_cost.buckets + expert_cost.buckets)
    # Pipelined buckets: the longer stream sets the pace; one bucket of the shorter one is
    # exposed at the start (first gather) and end (last return).
    exposed = min(compute, comm) / buckets * 2 if comm > 0 else 0.0
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


def gpus_for_target(
    layers,
    target_s: float,
    hw: Hardware | None = None,
    candidates: Sequence[int] | None = None,
    **kw,
) -> tuple[int | None, list[StepCost]]:
    """Smallest GPU count among `candidates` whose predicted step time is <= target_s."""
    candidates = candidates or [8 * 2**i for i in range(0, 10)]
    results = []
    for n in candidates:
        c = predict_step(layers, n, hw, **kw)
        results.append(c)
        if c.total_s <= target_s:
            return n, results
    return None, results


def model_layers_from_units(named: Sequence[tuple[str, tuple[int, ...], Units]]):
    """Group a model's (name, shape, units) list into identical layers: [(count, params)].

    Parameters are keyed by their name with the layer index removed, so all MoE layers
    (and all dense layers) with the same shapes collapse into one entry each.
    """
    import re

    groups: dict[tuple, list] = {}
    order: list[tuple] = []
    for name, shape, units in named:
        m = re.search(r"layers\.(\d+)\.", name)
        layer = int(m.group(1)) if m else -1
        key_name = re.sub(r"layers\.\d+\.", "layers.*.", name)
        groups.setdefault(layer, []).append((key_name, tuple(shape), units))
        if layer not in order:
            order.append(layer)
    buckets: dict[tuple, int] = {}
    params_of: dict[tuple, list] = {}
    for layer in order:
        sig = tuple((n, s, u) for n, s, u in groups[layer])
        buckets[sig] = buckets.get(sig, 0) + 1
        params_of[sig] = [(s, u) for _, s, u in groups[layer]]
    return [(count, params_of[sig]) for sig, count in buckets.items()]


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
    "describe",
    "gpus_for_target",
    "model_layers_from_units",
    "predict_step",
]
