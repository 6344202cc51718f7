"""Planning sharded Muon: which rank holds which part of which unit, who orthogonalizes it,
and what every rank sends to whom. Pure functions on shapes; no communication here.

Every parameter is split into its natural units (a head block, an expert, a whole matrix).
Under FSDP2/EP a rank holds a box (a product of index ranges) of each parameter; a unit is a
box too, so the part of a unit a rank holds is a box intersection. Each unit is assembled on
one owner rank, orthogonalized there, and its pieces are sent back. All ranks compute the
same plan from the same inputs, so no metadata is exchanged at step time.

Owners are chosen per bucket of equal unit shape by longest-processing-time on Newton-Schulz
cost, preferring the rank that already holds most of the unit (fewest bytes moved) as long as
that keeps the load within `balance_slack` of the ideal. A unit held whole by one rank (e.g.
an expert under expert sharding) stays there: nothing is sent for it.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from cadenza.model.units import Units


@dataclass(frozen=True)
class Box:
    """Half-open index ranges [start, stop) per dimension."""

    start: tuple[int, ...]
    stop: tuple[int, ...]

    @staticmethod
    def full(shape: Sequence[int]) -> Box:
        return Box(tuple(0 for _ in shape), tuple(shape))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(max(0, b - a) for a, b in zip(self.start, self.stop))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def intersect(self, other: Box) -> Box | None:
        start = tuple(max(a, b) for a, b in zip(self.start, other.start))
        stop = tuple(min(a, b) for a, b in zip(self.stop, other.stop))
        if any(b <= a for a, b in zip(start, stop)):
            return None
        return Box(start, stop)

    def relative_to(self, outer: Box) -> tuple[slice, ...]:
        """Index of this box inside a tensor that holds `outer`."""
        return tuple(slice(a - o, b - o) for a, b, o in zip(self.start, self.stop, outer.start))


@dataclass(frozen=True)
class ShardSpec:
    """One Shard(dim) placement: `dim` split into `num_chunks` chunks, this rank's is `index`."""

    dim: int
    num_chunks: int
    index: int


def chunk_range(size: int, num_chunks: int, index: int) -> tuple[int, int]:
    """torch.chunk / DTensor Shard semantics: chunks of ceil(size/n); trailing ones may be empty."""
    full = -(-size // num_chunks) if size else 0
    start = min(full * index, size)
    return start, min(start + full, size)


def local_box(shape: Sequence[int], specs: Sequence[ShardSpec]) -> Box:
    """The box of a tensor a rank holds under nested Shard placements, applied in order
    (outer mesh dimension first, as DTensor does for several shardings of one dim)."""
    start = [0] * len(shape)
    stop = list(shape)
    for s in specs:
        a, b = chunk_range(stop[s.dim] - start[s.dim], s.num_chunks, s.index)
        start[s.dim], stop[s.dim] = start[s.dim] + a, start[s.dim] + b
    return Box(tuple(start), tuple(stop))


def unit_boxes(shape: Sequence[int], units: Units) -> list[Box]:
    """Each natural unit of a parameter as a box in the parameter's coordinates."""
    out = []
    for idx in units.slices(tuple(shape)):
        start, stop = [], []
        for d, i in enumerate(idx):
            if isinstance(i, int):
                start.append(i)
                stop.append(i + 1)
            else:
                a, b, _ = i.indices(shape[d])
                start.append(a)
                stop.append(b)
        out.append(Box(tuple(start), tuple(stop)))
    return out


def matrix_shape(box: Box) -> tuple[int, int]:
    """A unit box seen as the matrix Newton-Schulz works on (expert boxes drop their E dim)."""
    s = box.shape
    return (s[-2], s[-1])


def ns_flops(rows: int, cols: int, steps: int = 5) -> int:
    """Newton-Schulz cost: 4 m^2 n + 2 m^3 per iteration for an m x n matrix, m <= n."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m**3)


@dataclass
class UnitWork:
    param: int  # index into the planned parameter list
    box: Box  # in the parameter's coordinates
    pieces: dict[int, Box]  # rank -> the part of this unit that rank holds (non-empty only)
    owner: int = -1
    # Every rank holds the whole unit (not sharded in this group): each rank orthogonalizes
    # its own copy; nothing is sent. `owner` is then -1 and `pieces` is empty.
    replicated: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return matrix_shape(self.box)

    @property
    def numel(self) -> int:
        return self.box.numel


@dataclass
class Bucket:
    shape: tuple[int, int]
    units: list[int]  # indices into Plan.units, in the canonical order used for packing


@dataclass
class Plan:
    world: int
    units: list[UnitWork]
    buckets: list[Bucket]
    local_boxes: list[list[Box]]  # [param][rank]
    ns_steps: int = 5
    stats: dict[str, float] = field(default_factory=dict)

    def send_counts(self, bucket: Bucket, rank: int) -> list[int]:
        """Elements `rank` sends to each rank when gathering `bucket` (self included)."""
        counts = [0] * self.world
        for u in bucket.units:
            w = self.units[u]
            piece = w.pieces.get(rank)
            if piece is not None:
                counts[w.owner] += piece.numel
        return counts

    def recv_counts(self, bucket: Bucket, rank: int) -> list[int]:
        """Elements `rank` receives from each rank when gathering `bucket` (self included)."""
        counts = [0] * self.world
        for u in bucket.units:
            w = self.units[u]
            if w.owner == rank:
                for src, piece in w.pieces.items():
                    counts[src] += piece.numel
        return counts

    def replicated_units(self) -> list[int]:
        return [i for i, w in enumerate(self.units) if w.replicated]

    def owned(self, bucket: Bucket, rank: int) -> list[int]:
        return [u for u in bucket.units if self.units[u].owner == rank]

    def bytes_per_rank(self, elem_bytes: int) -> list[int]:
        """Bytes each rank sends to other ranks in one step: its pieces of units owned
        elsewhere (gather) plus, as an owner, the other ranks' pieces (return)."""
        sent = [0] * self.world
        for w in self.units:
            for src, piece in w.pieces.items():
                if src != w.owner:
                    sent[src] += piece.numel
                    sent[w.owner] += piece.numel
        return [x * elem_bytes for x in sent]

    def bytes_sent(self, rank: int, elem_bytes: int) -> int:
        return self.bytes_per_rank(elem_bytes)[rank]

    def lower_bound_bytes(self, elem_bytes: int) -> int:
        """Total bytes any owner choice must move: each split unit's data minus its largest
        local piece, there and back."""
        total = 0
        for w in self.units:
            if w.pieces:
                total += 2 * (w.numel - max(p.numel for p in w.pieces.values()))
        return total * elem_bytes

    def total_bytes(self, elem_bytes: int) -> int:
        return sum(self.bytes_per_rank(elem_bytes))

    def flops_per_rank(self) -> list[int]:
        loads = [0] * self.world
        for w in self.units:
            c = ns_flops(*w.shape, self.ns_steps)
            if w.replicated:
                for r in range(self.world):
                    if self.local_boxes[w.param][r].numel:
                        loads[r] += c
            else:
                loads[w.owner] += c
        return loads

    def load_balance(self) -> float:
        """max / mean Newton-Schulz FLOPs per rank (1.0 is perfect)."""
        loads = self.flops_per_rank()
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean else 1.0


def assign_owners(
    costs: Sequence[int],
    holdings: Sequence[dict[int, int]],
    world: int,
    loads: list[int] | None = None,
    balance_slack: float = 0.05,
    allowed: Sequence[Sequence[int]] | None = None,
) -> list[int]:
    """Owner per unit: longest-processing-time first; each unit goes to the rank holding most
    of it unless that would push the rank above (1 + slack) x the ideal load, else to the least
    loaded rank among `allowed[i]` (default: all). A unit held entirely by one rank always
    stays there. `loads` carries load between buckets and is updated in place."""
    loads = loads if loads is not None else [0] * world
    owners = [-1] * len(costs)
    n_allowed = [len(a) for a in allowed] if allowed is not None else [world] * len(costs)
    # Ideal load of a rank: its share of the work of the groups it can take.
    target = (sum(c / k for c, k in zip(costs, n_allowed)) + sum(loads) / world) if costs else 0
    # Pinned units first: they have no choice, and the others balance around them.
    for i, h in enumerate(holdings):
        if len(h) == 1:
            (r,) = h
            owners[i] = r
            loads[r] += costs[i]
    order = sorted((i for i in range(len(costs)) if owners[i] < 0), key=lambda i: (-costs[i], i))
    everyone = range(world)
    for i in order:
        h = holdings[i]
        cands = allowed[i] if allowed is not None else everyone
        best = min(h, key=lambda r: (-h[r], loads[r], r)) if h else None
        least = min(cands, key=lambda r: (loads[r], r))
        if best is not None and loads[best] + costs[i] <= max(
            target * (1 + balance_slack), loads[least] + costs[i]
        ):
            owners[i] = best
        else:
            owners[i] = least
        loads[owners[i]] += costs[i]
    return owners


def _candidate_ranks(rank_boxes: Sequence[Box]):
    """A function giving the ranks whose box may intersect a query box. When the ranks' boxes
    differ along one dimension only (one Shard placement, the common case), a bisection on
    that dimension finds them in O(log world); otherwise all ranks are candidates."""
    world = len(rank_boxes)
    nonempty = [r for r in range(world) if rank_boxes[r].numel > 0]
    if not nonempty:
        return lambda ub: []
    ndim = len(rank_boxes[nonempty[0]].start)
    varying = [
        d
        for d in range(ndim)
        if len({(rank_boxes[r].start[d], rank_boxes[r].stop[d]) for r in nonempty}) > 1
    ]
    if len(varying) != 1:
        return lambda ub: nonempty
    d = varying[0]
    order = sorted(nonempty, key=lambda r: rank_boxes[r].start[d])
    starts = [rank_boxes[r].start[d] for r in order]

    def find(ub: Box) -> list[int]:
        lo = max(bisect.bisect_right(starts, ub.start[d]) - 1, 0)
        hi = bisect.bisect_left(starts, ub.stop[d])
        return order[lo:hi]

    return find


def make_plan(
    shapes: Sequence[Sequence[int]],
    units: Sequence[Units],
    shard_specs: Sequence[Sequence[Sequence[ShardSpec]]],
    world: int,
    bucket_numel: int = 1 << 24,
    ns_steps: int = 5,
    balance_slack: float = 0.05,
) -> Plan:
    """Plan one optimizer step's Newton-Schulz work from Shard placements.

    shapes[p]: global shape of parameter p; units[p]: its declared units;
    shard_specs[p][r]: the Shard placements of parameter p on rank r of the group (empty for
    a replicated parameter: every rank holds all of it). Ranks are group-local (0..world-1).
    """
    boxes = [
        [local_box(shapes[p], shard_specs[p][r]) for r in range(world)] for p in range(len(shapes))
    ]
    return plan_from_boxes(shapes, units, boxes, world, None, bucket_numel, ns_steps, balance_slack)


def plan_from_boxes(
    shapes: Sequence[Sequence[int]],
    units: Sequence[Units],
    boxes: Sequence[Sequence[Box]],
    world: int,
    groups: Sequence[Sequence[int]] | None = None,
    bucket_numel: int = 1 << 24,
    ns_steps: int = 5,
    balance_slack: float = 0.05,
) -> Plan:
    """Plan from explicit boxes: boxes[p][r] is the part of parameter instance p rank r holds
    (an empty box where it holds none). groups[p] lists the ranks among which instance p is
    partitioned (default: all); its units get owners only in that group. One instance per
    (parameter, replica group) lets a single plan over all ranks serve HSDP: replicas run the
    same work independently, and no bytes cross replica groups.
    Buckets hold units of one matrix shape, at most `bucket_numel` elements each.
    """
    groups = [list(g) for g in groups] if groups is not None else [list(range(world))] * len(shapes)
    work: list[UnitWork] = []
    for p, (shape, u) in enumerate(zip(shapes, units)):
        find = _candidate_ranks(boxes[p])
        size = len(groups[p])
        for ub in unit_boxes(shape, u):
            pieces = {}
            for r in find(ub):
                inter = ub.intersect(boxes[p][r])
                if inter is not None:
                    pieces[r] = inter
            if size > 1 and len(pieces) == size and all(pc == ub for pc in pieces.values()):
                work.append(UnitWork(p, ub, {}, replicated=True))
            else:
                if not pieces:
                    raise ValueError(
                        f"parameter {p}: no rank holds unit {ub}; the shard boxes do not cover it"
                    )
                work.append(UnitWork(p, ub, pieces))
    by_shape: dict[tuple[int, int], list[int]] = {}
    loads = [0] * world
    for i, w in enumerate(work):
        if w.replicated:
            for r in groups[w.param]:
                loads[r] += ns_flops(*w.shape, ns_steps)
        else:
            by_shape.setdefault(w.shape, []).append(i)
    buckets: list[Bucket] = []
    # Largest work first so later, smaller buckets fill in the balance.
    for shape in sorted(by_shape, key=lambda s: (-ns_flops(*s, ns_steps), s)):
        idx = by_shape[shape]
        costs = [ns_flops(*shape, ns_steps)] * len(idx)
        holdings = [{r: pc.numel for r, pc in work[i].pieces.items()} for i in idx]
        allowed = [groups[work[i].param] for i in idx]
        owners = assign_owners(costs, holdings, world, loads, balance_slack, allowed)
        for i, o in zip(idx, owners):
            work[i].owner = o
        per_unit = shape[0] * shape[1]
        cap = max(1, bucket_numel // max(per_unit, 1))
        for s in range(0, len(idx), cap):
            buckets.append(Bucket(shape, idx[s : s + cap]))
    plan = Plan(world, work, buckets, [list(b) for b in boxes], ns_steps)
    plan.stats = {
        "units": len(work),
        "buckets": len(buckets),
        "load_balance": plan.load_balance(),
    }
    return plan
