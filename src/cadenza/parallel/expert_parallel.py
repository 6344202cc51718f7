"""Expert parallelism: routed experts split over the ep group, tokens moved by all-to-all.

Each of the P ranks of an ep group owns E/P consecutive experts (rank p: experts
[p E/P, (p+1) E/P)). A MoE layer hands its experts the tokens grouped by expert id with the
count per expert; here that becomes

    dispatch: send each expert's tokens to its owner      (all_to_all_single, uneven splits)
    compute:  the owner runs its local experts            (the model's own expert code)
    combine:  send the outputs back, in the original order (all_to_all_single, reversed splits)

The all-to-all is an autograd function whose backward is the reverse all-to-all, so
gradients of tokens and of expert weights equal a single-process run. Verified on gloo in
torch 2.13: all_to_all_single supports uneven splits (used directly, no fallback needed).

Expert weights are DTensors sharded Shard(0) on ep: checkpoints see the global [E, ...]
stacks, and FSDP2 composes with them (it shards the local E/P experts further over the
expert data-parallel dims).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.func import functional_call


class _AllToAll(torch.autograd.Function):
    """y = all_to_all(x) with per-rank row counts; backward sends gradients the reverse way."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        y = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(y, x.contiguous(), out_splits, in_splits, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        g = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(g, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return g, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Autograd-aware uneven all_to_all_single over rows of `x`."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """Token counts per (source rank, local expert) that this rank will receive.

    counts: [E] tokens this rank routes to each global expert. Returns [P, E/P]: row p holds
    how many tokens rank p sends to each of this rank's experts.
    """
    p = dist.get_world_size(group)
    send = counts.to(torch.int64).reshape(p, -1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def group_by_expert_permutation(recv: torch.Tensor) -> torch.Tensor:
    """Permutation taking received rows (source-major) to local-expert-major order.

    recv: [P, L] counts. Received rows come as segments (p, e) in order p, then e; the
    stable sort on the local expert id of each row groups them by expert, keeping source
    order inside each expert (so the result is deterministic).
    """
    p, local = recv.shape
    expert_of_segment = torch.arange(local).repeat(p)
    expert_of_row = torch.repeat_interleave(expert_of_segment, recv.reshape(-1))
    return torch.sort(expert_of_row, stable=True).indices


class ExpertParallel(nn.Module):
    """Drop-in replacement for a model's routed-experts module under expert parallelism.

    Takes the model's module (called as `experts(x_sorted, counts)` with tokens grouped by
    expert, parameters stacked on dim 0 = expert) and keeps its parameter names, so state
    dicts match the single-process model. The parameters become DTensors Shard(0) on the ep
    mesh; forward dispatches, runs the model's own code on the local experts (through
    `functional_call` on a parameter-free template), and combines.
    """

    def __init__(self, experts: nn.Module, ep_mesh) -> None:
        super().__init__()
        names = [n for n, _ in experts.named_parameters(recurse=False)]
        if not names:
            raise ValueError(
                f"{type(experts).__name__}: expected stacked expert parameters [E, ...] "
                "directly on the experts module, found none"
            )
        n_experts = {experts.get_parameter(n).shape[0] for n in names}
        if len(n_experts) != 1:
            raise ValueError(
                f"{type(experts).__name__}: parameters disagree on the expert count (dim 0): "
                f"{sorted(n_experts)}"
            )
        self.n_experts = n_experts.pop()
        self.ep_mesh = ep_mesh
        self.ep = ep_mesh.size()
        if self.n_experts % self.ep:
            raise ValueError(
                f"rule 'n_routed_experts divisible by ep': {self.n_experts} experts over "
                f"ep={self.ep} ranks"
            )
        for n in names:
            p = experts.get_parameter(n)
            d = distribute_tensor(p.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            self.register_parameter(n, nn.Parameter(d, requires_grad=p.requires_grad))
            # The template keeps only the code: its parameter slots are filled per call.
            delattr(experts, n)
            experts.register_parameter(n, None)
        self._template = [experts]  # a list, so the template is not a registered submodule
        self._names = names

    def param_units(self) -> dict:
        """The wrapped module's natural-unit declaration (one unit per expert), unchanged."""
        template = self._template[0]
        return template.param_units() if hasattr(template, "param_units") else {}

    def local_weights(self) -> dict[str, torch.Tensor]:
        out = {}
        for n in self._names:
            p = getattr(self, n)
            out[n] = p.to_local() if isinstance(p, DTensor) else p
        return out

    def forward(self, x: torch.Tensor, counts: torch.Tensor, *args: Any, **kwargs: Any):
        group = self.ep_mesh.get_group()
        recv = exchange_counts(counts, group)
        send_splits = counts.reshape(self.ep, -1).sum(1).tolist()
        recv_splits = recv.sum(1).tolist()
        x_recv = all_to_all(x, recv_splits, send_splits, group)
        perm = group_by_expert_permutation(recv)
        local_counts = recv.sum(0)
        y = functional_call(
            self._template[0], self.local_weights(), (x_recv[perm], local_counts, *args), kwargs
        )
        y_back = y[torch.argsort(perm)]  # undo the grouping
        return all_to_all(y_back, send_splits, recv_splits, group)


def apply_expert_parallel(model: nn.Module, ep_mesh, experts_attr: str = "experts") -> int:
    """Replace every MoE layer's routed experts with an ExpertParallel wrapper; returns count.

    A MoE layer is any module with an `experts_attr` submodule holding 3-D stacked params.
    """
    targets = []
    for _, module in model.named_modules():
        child = getattr(module, experts_attr, None)
        if isinstance(child, nn.Module) and not isinstance(child, ExpertParallel):
            params = list(child.parameters(recurse=False))
            if params and all(p.ndim == 3 for p in params):
                targets.append(module)
    for module in targets:
        setattr(module, experts_attr, ExpertParallel(getattr(module, experts_attr), ep_mesh))
    return len(targets)
