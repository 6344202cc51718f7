"""Sharded Muon: Newton-Schulz on natural units of FSDP2/EP-sharded parameters, exact.

Every rank holds boxes of the parameters (DTensor shards); Newton-Schulz needs whole units.
Per step:

1. Momentum and the Nesterov direction are elementwise, so each rank computes them on its
   own shard (exactly as single-process Muon would on those elements).
2. Units of one shape form buckets (size-bounded). Per bucket, one ragged
   `all_to_all_single` sends every rank's pieces of each unit to the unit's owner, the owner
   runs one batched Newton-Schulz over its units, and a second ragged all-to-all returns the
   orthogonalized pieces. Units a rank holds whole stay there and send nothing (experts
   sharded on the expert dimension); units every rank holds whole are done locally.
3. Each rank applies decoupled weight decay and W <- W - lr s(U) O_U to its shard.

Transfers are asynchronous: up to `max_in_flight` buckets are being gathered while another
is orthogonalized, so communication overlaps compute; extra memory is bounded by the
buckets in flight. The plan (who holds what, owners by longest-processing-time on NS cost)
is computed once from the parameters' placements on every rank alike, with no exchange.

One plan spans all ranks of the default process group (both of cadenza's meshes are
factorizations of the same world): a parameter instance per replica group, so HSDP replicas
each run their share independently and no bytes cross replica groups.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from cadenza.model.units import MATRIX, Units
from cadenza.optim.muon import AdjustLR, NonFinite, muon_defaults, unit_scale
from cadenza.optim.newton_schulz import Coefficients, newton_schulz_, resolve_dtype
from cadenza.optim.shard_plan import Box, Plan, plan_from_boxes


@dataclass
class _Param:
    name: str
    param: Tensor  # DTensor or plain tensor (then replicated on every rank)
    units: Units
    instance: int  # index of this rank's instance of the parameter in the plan
    box: Box  # this rank's box in global coordinates


def _placement_boxes(p: Tensor, world: int) -> tuple[list[list[Box]], list[list[int]]]:
    """Boxes per global rank, one list per replica group ("instance") of parameter `p`.

    Ranks outside the parameter's mesh, or in another replica group, get empty boxes in an
    instance. Placements other than Shard/_StridedShard/Replicate are refused."""
    shape = tuple(p.shape)
    empty = Box(tuple(0 for _ in shape), tuple(0 for _ in shape))
    if not isinstance(p, DTensor):
        return [[Box.full(shape)] * world], [list(range(world))]
    mesh, placements = p.device_mesh, p.placements
    for pl in placements:
        if not isinstance(pl, (Shard, _StridedShard, Replicate)):
            raise ValueError(
                f"sharded Muon: placement {pl} is not supported (only Shard, _StridedShard and Replicate; "
                f"Partial gradients must be reduced before the optimizer step)"
            )
    coords = mesh.mesh  # tensor of global ranks, shape = mesh.shape
    shard_dims = [i for i, pl in enumerate(placements) if isinstance(pl, (Shard, _StridedShard))]
    rep_dims = [i for i in range(mesh.ndim) if i not in shard_dims]
    instances: dict[tuple, list[Box]] = {}
    groups: dict[tuple, list[int]] = {}
    for coord in itertools.product(*(range(s) for s in mesh.shape)):
        rank = int(coords[coord])
        local_shape, offset = _compute_local_shape_and_global_offset(
            shape, tuple(mesh.shape), list(coord), placements
        )
        key = tuple(coord[d] for d in rep_dims)
        boxes = instances.setdefault(key, [empty] * world)
        box = Box(tuple(offset), tuple(o + s for o, s in zip(offset, local_shape)))
        boxes[rank] = box if box.numel else empty
        groups.setdefault(key, []).append(rank)
    out_boxes, out_groups = [], []
    for key in sorted(instances):
        boxes = instances[key]
        covered = sum(b.numel for b in boxes)
        total = torch.Size(shape).numel()
        if covered != total:
            raise ValueError(
                f"sharded Muon: the local shards of a {shape} parameter with placements "
                f"{placements} on mesh {tuple(mesh.shape)} do not tile it as boxes "
                f"({covered} of {total} elements); such interleaved layouts are not supported"
            )
        out_boxes.append(boxes)
        out_groups.append(sorted(groups[key]))
    return out_boxes, out_groups


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ShardedMuon(torch.optim.Optimizer):
    """Muon over natural units of DTensor-sharded parameters; equals `Muon` on full tensors.

    `params`: (name, tensor, Units) triples as from `cadenza.model.units.param_units` on a
    model parallelized with cadenza.parallel (FSDP2 on the dense and expert meshes, EP).
    Every rank must pass the same parameters in the same order. Plain (non-DTensor)
    tensors are treated as replicated on every rank.

    bucket_numel bounds the elements of one bucket (the extra memory per bucket in flight is
    about 3x that: the gather buffer, the NS stack, the return buffer); max_in_flight is the
    number of buckets being transferred while one is orthogonalized.
    """

    def __init__(
        self,
        params: Iterable[tuple[str, Tensor, Units]],
        lr: float = 1e-3,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        adjust_lr: AdjustLR | None = "original",
        ns_steps: int = 5,
        ns_coefficients: Coefficients | tuple[float, float, float] = "quintic",
        ns_dtype: torch.dtype | str = "bfloat16",
        eps: float = 1e-7,
        nonfinite: NonFinite = "error",
        bucket_numel: int = 1 << 22,
        max_in_flight: int = 2,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "ShardedMuon needs torch.distributed to be initialized; use cadenza.optim.Muon "
                "for a single process"
            )
        if max_in_flight < 1:
            raise ValueError(f"ShardedMuon: max_in_flight must be >= 1, found {max_in_flight}")
        defaults = muon_defaults(
            "ShardedMuon",
            lr,
            momentum,
            nesterov,
            weight_decay,
            adjust_lr,
            ns_steps,
            ns_coefficients,
            ns_dtype,
            eps,
            nonfinite,
        )
        entries = []
        for i, e in enumerate(params):
            if not (isinstance(e, tuple) and len(e) == 3):
                raise TypeError(
                    f"ShardedMuon: params must be (name, tensor, Units) triples, found "
                    f"{type(e).__name__} at position {i}"
                )
            name, p, u = e
            u = u or MATRIX
            if u.kind == "adamw":
                raise ValueError(f"ShardedMuon: {name} is declared 'adamw'; give it to AdamW")
            if p.is_complex():
                raise ValueError(f"ShardedMuon: {name} is complex; Muon needs real matrices")
            u.check(tuple(p.shape), name)
            entries.append((name, p, u))
        self.group = group or dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        if self.group is not dist.group.WORLD and any(
            isinstance(p, DTensor) for _, p, _ in entries
        ):
            raise ValueError("ShardedMuon: DTensor parameters need the default (world) group")
        self.nonfinite = nonfinite
        self.skipped_steps = 0
        self.last_step_bytes = 0  # bytes this rank sent to other ranks in the last step
        self.bucket_numel = int(bucket_numel)
        self.max_in_flight = int(max_in_flight)
        super().__init__([{"params": [p for _, p, _ in entries]}], defaults)
        self.param_groups[0]["param_names"] = [n for n, _, _ in entries]
        self._build_plan(entries)

    # ------------------------------------------------------------ planning
    def _build_plan(self, entries: list[tuple[str, Tensor, Units]]) -> None:
        shapes, units, boxes, groups = [], [], [], []
        self._params: list[_Param] = []
        for name, p, u in entries:
            inst_boxes, inst_groups = _placement_boxes(p, self.world)
            mine = None
            for b, g in zip(inst_boxes, inst_groups):
                if self.rank in g:
                    mine = len(shapes)
                shapes.append(tuple(p.shape))
                units.append(u)
                boxes.append(b)
                groups.append(g)
            if mine is None:
                raise ValueError(f"ShardedMuon: rank {self.rank} holds no part of {name}")
            self._params.append(_Param(name, p, u, mine, boxes[mine][self.rank]))
        self.plan: Plan = plan_from_boxes(
            shapes,
            units,
            boxes,
            self.world,
            groups,
            bucket_numel=self.bucket_numel,
            ns_steps=self.defaults["ns_steps"],
        )
        by_instance = {pp.instance: k for k, pp in enumerate(self._params)}
        self._unit_param = [by_instance.get(w.param) for w in self.plan.units]
        self.stats: dict[str, Any] = dict(self.plan.stats)
        self.stats["bytes_sent_per_rank"] = self.plan.bytes_per_rank(4)

    # ------------------------------------------------------------ state
    def _momentum(self, pp: _Param) -> Tensor:
        state = self.state[pp.param]
        if "momentum_buffer" not in state:
            p = pp.param
            local = torch.zeros_like(_local(p))
            if isinstance(p, DTensor):
                state["momentum_buffer"] = DTensor.from_local(
                    local,
                    p.device_mesh,
                    p.placements,
                    shape=p.shape,
                    stride=p.stride(),
                    run_check=False,
                )
            else:
                state["momentum_buffer"] = local
        return _local(state["momentum_buffer"])

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["skipped_steps"] = self.skipped_steps
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        self.skipped_steps = int(state_dict.pop("skipped_steps", 0))
        super().load_state_dict(state_dict)

    # ------------------------------------------------------------ step
    def _all_finite(self, grads: list[Tensor]) -> bool:
        bad = torch.zeros((), dtype=torch.float32)
        if grads:
            norms = torch._foreach_norm(grads)
            if not bool(torch.isfinite(torch.stack(norms).sum())):
                bad.fill_(1.0)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)
        return bad.item() == 0.0

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        group = self.param_groups[0]
        mu, lr, wd = group["momentum"], float(group["lr"]), group["weight_decay"]
        dtype = resolve_dtype(group["ns_dtype"])
        live = [pp for pp in self._params if pp.param.grad is not None]
        if len(live) not in (0, len(self._params)):
            missing = [pp.name for pp in self._params if pp.param.grad is None][:3]
            raise RuntimeError(
                f"ShardedMuon: some parameters have no gradient (e.g. {missing}); every rank "
                f"must step all parameters together (zero their gradients instead of None)"
            )
        if not live:
            return loss
        grads = [_local(pp.param.grad) for pp in live]
        if self.nonfinite != "ignore" and not self._all_finite(grads):
            if self.nonfinite == "skip":
                self.skipped_steps += 1
                return loss
            raise FloatingPointError(
                "ShardedMuon: non-finite gradient on some rank; lower the learning rate or "
                "check the batch, or use nonfinite='skip'"
            )
        # 1. elementwise momentum / Nesterov on local shards
        directions = []
        for pp, g in zip(live, grads):
            buf = self._momentum(pp)
            buf.lerp_(g, 1 - mu)
            directions.append(g.lerp(buf, mu) if group["nesterov"] else buf)
        self.last_step_bytes = 0
        # 2. decoupled weight decay, then each unit's W_U += -lr s(U) O_U as its O_U arrives
        # (the same operations, in the same order, as single-process Muon)
        weights = [_local(pp.param) for pp in live]
        if wd:
            torch._foreach_mul_(weights, 1 - lr * wd)
        self._replicated_units(directions, weights, group, dtype, lr)
        self._pipeline(directions, weights, group, dtype, lr)
        return loss

    def _ns(self, stack: Tensor, group) -> Tensor:
        return newton_schulz_(stack, group["ns_steps"], group["ns_coefficients"], group["eps"])

    def _alpha(self, shape: tuple[int, int], group, lr: float) -> float:
        return -lr * unit_scale(shape[0], shape[1], group["adjust_lr"])

    def _replicated_units(self, directions, weights, group, dtype, lr) -> None:
        by_shape: dict[tuple[int, int], list[int]] = {}
        for u in self.plan.replicated_units():
            k = self._unit_param[u]
            if k is not None and self._params[k].instance == self.plan.units[u].param:
                by_shape.setdefault(self.plan.units[u].shape, []).append(u)
        for shape, us in by_shape.items():
            stack = torch.empty(len(us), *shape, dtype=dtype)
            for j, u in enumerate(us):
                w = self.plan.units[u]
                pp = self._params[self._unit_param[u]]
                stack[j].view(w.box.shape).copy_(
                    directions[self._unit_param[u]][w.box.relative_to(pp.box)]
                )
            out = self._ns(stack, group)
            alpha = self._alpha(shape, group, lr)
            for j, u in enumerate(us):
                w = self.plan.units[u]
                pp = self._params[self._unit_param[u]]
                weights[self._unit_param[u]][w.box.relative_to(pp.box)].add_(
                    out[j].view(w.box.shape), alpha=alpha
                )

    def _pipeline(self, directions, weights, group, dtype, lr) -> None:
        plan, me = self.plan, self.rank
        buckets = plan.buckets
        # Slices travel in the Newton-Schulz dtype: the owner would round them to it anyway,
        # and the holder adds the result as single-process Muon adds its NS output.
        send_dtype = dtype
        pending: dict[int, tuple] = {}
        returns: list[tuple] = []

        def start_gather(b: int) -> None:
            bucket = buckets[b]
            send_counts = plan.send_counts(bucket, me)
            recv_counts = plan.recv_counts(bucket, me)
            parts = []
            for dst in range(self.world):
                if not send_counts[dst]:
                    continue
                for u in bucket.units:
                    w = plan.units[u]
                    if w.owner == dst and me in w.pieces:
                        k = self._unit_param[u]
                        parts.append(
                            directions[k][w.pieces[me].relative_to(self._params[k].box)].reshape(-1)
                        )
            send = torch.cat(parts).to(send_dtype) if parts else torch.empty(0, dtype=send_dtype)
            recv = torch.empty(sum(recv_counts), dtype=send_dtype)
            self.last_step_bytes += (sum(send_counts) - send_counts[me]) * send.element_size()
            work = dist.all_to_all_single(
                recv, send, recv_counts, send_counts, group=self.group, async_op=True
            )
            pending[b] = (work, recv, recv_counts, send_counts, send)

        in_flight = min(self.max_in_flight, len(buckets))
        for b in range(in_flight):
            start_gather(b)
        for b, bucket in enumerate(buckets):
            work, recv, recv_counts, send_counts, _send = pending.pop(b)
            if b + in_flight < len(buckets):
                start_gather(b + in_flight)  # keep the link busy while we compute
            work.wait()
            owned = plan.owned(bucket, me)
            stack = torch.empty(len(owned), *bucket.shape, dtype=dtype)
            slot = {u: j for j, u in enumerate(owned)}
            offset = 0
            for src in range(self.world):
                if not recv_counts[src]:
                    continue
                for u in owned:
                    w = plan.units[u]
                    piece = w.pieces.get(src)
                    if piece is None:
                        continue
                    n = piece.numel
                    view = stack[slot[u]].view(w.box.shape)
                    view[piece.relative_to(w.box)] = recv[offset : offset + n].view(piece.shape)
                    offset += n
            out = self._ns(stack, group) if owned else stack
            alpha = self._alpha(bucket.shape, group, lr)
            # Return the orthogonalized pieces, in the order each holder packed them.
            back_counts = recv_counts
            parts = []
            for dst in range(self.world):
                if not back_counts[dst]:
                    continue
                for u in owned:
                    w = plan.units[u]
                    piece = w.pieces.get(dst)
                    if piece is not None:
                        view = out[slot[u]].view(w.box.shape)
                        parts.append(view[piece.relative_to(w.box)].reshape(-1))
            back = torch.cat(parts).to(send_dtype) if parts else torch.empty(0, dtype=send_dtype)
            got = torch.empty(sum(send_counts), dtype=send_dtype)
            self.last_step_bytes += (sum(back_counts) - back_counts[me]) * back.element_size()
            rwork = dist.all_to_all_single(
                got, back, send_counts, back_counts, group=self.group, async_op=True
            )
            returns.append((rwork, got, send_counts, bucket, alpha, back))
            # Drain returns beyond the in-flight budget to bound memory.
            while len(returns) > self.max_in_flight:
                self._finish_return(returns.pop(0), weights)
        while returns:
            self._finish_return(returns.pop(0), weights)

    def _finish_return(self, item, weights) -> None:
        work, got, send_counts, bucket, alpha, _back = item
        work.wait()
        plan, me = self.plan, self.rank
        offset = 0
        for dst in range(self.world):
            if not send_counts[dst]:
                continue
            for u in bucket.units:
                w = plan.units[u]
                if w.owner == dst and me in w.pieces:
                    k = self._unit_param[u]
                    piece = w.pieces[me]
                    n = piece.numel
                    weights[k][piece.relative_to(self._params[k].box)].add_(
                        got[offset : offset + n].view(piece.shape), alpha=alpha
                    )
                    offset += n
