"""Muon at the model's natural granularity: per head, per expert, or per whole matrix.

For each natural unit U of a parameter W (a head's row block, an o_proj column block, one
expert's [out, in] matrix, or the whole matrix), with mu the momentum:

    M <- mu M + (1 - mu) G                      (EMA, as torch.optim.Muon; M is per parameter)
    V  = (1 - mu) G + mu M   (Nesterov)   or   M
    O_U = NS(V_U)                               (Newton-Schulz on the unit alone)
    W <- W (1 - lr wd)                          (decoupled weight decay, whole parameter)
    W_U <- W_U - lr s(U) O_U,   s(U) from the unit's own shape (`unit_scale`)

Units of equal shape across all parameters (tall ones transposed onto their wide twin) are
stacked and orthogonalized in one batched call per shape per step.

The functional core (`muon_direction`, `unit_scale`, `muon_unit_update`, `unit_views`) is
what the sharded optimizer reuses; `Muon` only keeps the momentum buffers and does the
bookkeeping of gathering unit views into stacks and writing results back.

Reproducing these results bit for bit elsewhere (e.g. with sharded parameters): momentum and
V are elementwise (`lerp` as in `muon_direction`, on any shard); each unit's V is cast to the
NS dtype, transposed if tall, and orthogonalized by `newton_schulz_` in any batch (on CPU the
result does not depend on the batch's other members, which tests check; GPU batched GEMMs may
pick other kernels for other batch sizes); then W <- W * (1 - lr wd) on the whole parameter,
and W_U.add_(O_U, alpha=-lr * unit_scale(r, c)) with O_U still in the NS dtype.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch import Tensor

from cadenza.model.units import MATRIX, Units
from cadenza.optim.newton_schulz import Coefficients, newton_schulz, newton_schulz_, resolve_dtype

AdjustLR = Literal["original", "match_rms_adamw"]
NonFinite = Literal["error", "skip", "ignore"]


# ---------------------------------------------------------------- functional core


def unit_scale(rows: int, cols: int, adjust_lr: AdjustLR | None = "original") -> float:
    """Update scale s(U) of an r x c unit.

    original:        max(1, r / c) ** 0.5   (Keller Jordan; torch.optim.Muon's default)
    match_rms_adamw: 0.2 * max(r, c) ** 0.5 (Moonshot; update RMS ~ AdamW's, so AdamW lr/wd carry over)
    """
    if adjust_lr is None or adjust_lr == "original":
        return math.sqrt(max(1, rows / cols))
    if adjust_lr == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr: expected 'original' or 'match_rms_adamw', found {adjust_lr!r}")


def muon_direction(
    grad: Tensor, momentum_buffer: Tensor, momentum: float, nesterov: bool
) -> Tensor:
    """Update the momentum buffer in place (M <- mu M + (1 - mu) G) and return the NS input V."""
    momentum_buffer.lerp_(grad, 1 - momentum)
    return grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer


def muon_unit_update(
    grad_units: Tensor,
    momentum_units: Tensor,
    *,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_dtype: torch.dtype | str = torch.bfloat16,
    ns_coefficients: Coefficients | tuple[float, float, float] = "quintic",
    eps: float = 1e-7,
) -> Tensor:
    """Muon on a stack of same-shape units [N, r, c]: updates `momentum_units` in place and
    returns the orthogonalized direction O [N, r, c] (in ns_dtype, not yet scaled).

    The caller applies W_U <- W_U (1 - lr wd) - lr * unit_scale(r, c) * O_U. Elementwise
    steps are identical to `Muon`'s per-parameter ones, so results match it bit for bit.
    """
    V = muon_direction(grad_units, momentum_units, momentum, nesterov)
    return newton_schulz(V, ns_steps, ns_dtype, ns_coefficients, eps)


def _period(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """Shortest block pattern that repeats to give `sizes` (per-head layouts repeat per head)."""
    n = len(sizes)
    for p in range(1, n + 1):
        if n % p == 0 and sizes[:p] * (n // p) == sizes:
            return sizes[:p]
    return sizes


def unit_views(t: Tensor, units: Units) -> list[Tensor]:
    """Views [k, r, c] of tensor `t` (a parameter, its gradient, its momentum) covering its units.

    Each view stacks the k units that share one position in the repeating per-head pattern, so
    a parameter yields one view per distinct block position (not one per head) and writes into
    a view land in `t`. Concatenating the views' units in order gives every unit exactly once.
    """
    units.check(t.shape)
    if units.kind == "matrix":
        return [t.unsqueeze(0)]
    if units.kind == "experts":
        return [t]
    if units.kind == "adamw":
        return []
    pattern = _period(units.sizes)
    heads, width = len(units.sizes) // len(pattern), sum(pattern)
    views = []
    start = 0
    for size in pattern:
        if units.kind == "rows":
            views.append(t.unflatten(0, (heads, width))[:, start : start + size, :])
        else:
            views.append(t.unflatten(1, (heads, width))[:, :, start : start + size].transpose(0, 1))
        start += size
    return views


def nonfinite_names(named_grads: list[tuple[str, Tensor]]) -> list[str]:
    """Names of the gradients that hold a NaN or an infinity (one fused reduction in the common case)."""
    if not named_grads:
        return []
    norms = torch._foreach_norm([g for _, g in named_grads])
    if bool(torch.isfinite(torch.stack(norms).sum())):
        return []
    return [
        name
        for (name, g), n in zip(named_grads, norms)
        if not bool(torch.isfinite(n)) or not bool(torch.isfinite(g).all())
    ]


def muon_defaults(
    who: str,
    lr: float,
    momentum: float,
    nesterov: bool,
    weight_decay: float,
    adjust_lr: AdjustLR | None,
    ns_steps: int,
    ns_coefficients: Coefficients | tuple[float, float, float],
    ns_dtype: torch.dtype | str,
    eps: float,
    nonfinite: NonFinite,
) -> dict[str, Any]:
    """Validated hyperparameters of a Muon optimizer (`who` names it in errors), as the
    param-group defaults both `Muon` and the sharded optimizer store."""
    if float(lr) < 0:
        raise ValueError(f"{who}: lr must be >= 0, found {lr}")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"{who}: momentum must be in [0, 1), found {momentum}")
    if weight_decay < 0:
        raise ValueError(f"{who}: weight_decay must be >= 0, found {weight_decay}")
    unit_scale(1, 1, adjust_lr)  # validates the name
    if not 0 <= ns_steps < 100:
        raise ValueError(f"{who}: ns_steps must be in [0, 100), found {ns_steps}")
    if nonfinite not in ("error", "skip", "ignore"):
        raise ValueError(
            f"{who}: nonfinite must be 'error', 'skip' or 'ignore', found {nonfinite!r}"
        )
    if isinstance(ns_dtype, torch.dtype):
        ns_dtype = str(ns_dtype).removeprefix("torch.")
    resolve_dtype(ns_dtype)
    return dict(
        lr=lr,
        momentum=momentum,
        nesterov=nesterov,
        weight_decay=weight_decay,
        adjust_lr=adjust_lr,
        ns_steps=ns_steps,
        ns_coefficients=ns_coefficients,
        ns_dtype=ns_dtype,
        eps=eps,
    )


# ---------------------------------------------------------------- stateful shell


class Muon(torch.optim.Optimizer):
    """Muon over matrices split into natural units.

    `params`: tensors, (name, tensor) pairs, (name, tensor, Units) triples (as yielded by
    `cadenza.model.units.param_units`), or param-group dicts holding any of these. A 2-D tensor
    without declared units is one `matrix` unit, and then this optimizer behaves exactly like
    torch.optim.Muon (same momentum convention, bf16 Newton-Schulz, lr adjustment and
    decoupled weight decay). Note the default weight_decay is 0.0 (torch's is 0.1).

    nonfinite: what a NaN/inf gradient does: "error" raises naming the parameters, "skip"
    leaves parameters and state untouched and counts the step in `skipped_steps`,
    "ignore" does not check (the caller did).
    """

    def __init__(
        self,
        params: Iterable[Any],
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
    ) -> None:
        defaults = muon_defaults(
            "Muon",
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
        self.nonfinite = nonfinite
        self.skipped_steps = 0
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        group = dict(param_group)
        entries = group["params"]
        entries = [entries] if isinstance(entries, Tensor) else list(entries)
        tensors, names, units = [], [], []
        for i, entry in enumerate(entries):
            if isinstance(entry, Tensor):
                name, p, u = None, entry, None
            elif isinstance(entry, tuple) and len(entry) in (2, 3):
                name, p, u = entry[0], entry[1], (entry[2] if len(entry) == 3 else None)
            else:
                raise TypeError(
                    f"Muon: params must be tensors, (name, tensor) or (name, tensor, Units), "
                    f"found {type(entry).__name__} at position {i}"
                )
            label = name or f"parameter {i} of group {len(self.param_groups)}"
            tensors.append(p)
            names.append(name)
            units.append(_check_param(p, u, label))
        if any(n is not None for n in names):
            if any(n is None for n in names):
                raise ValueError("Muon: give names for all parameters of a group or for none")
            group["params"] = list(zip(names, tensors))
        else:
            group["params"] = tensors
        group["units"] = units
        super().add_param_group(group)

    def state_dict(self) -> dict[str, Any]:
        """torch's layout (momentum_buffer per parameter) plus `skipped_steps`; unit layouts
        are stored as plain (kind, sizes) tuples so torch.load(weights_only=True) reads them."""
        sd = super().state_dict()
        for g in sd["param_groups"]:
            g["units"] = [_plain(u) for u in g["units"]]
        sd["skipped_steps"] = self.skipped_steps
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        skipped = int(state_dict.pop("skipped_steps", 0))
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError(
                f"Muon.load_state_dict: the checkpoint has {len(state_dict['param_groups'])} "
                f"param groups, this optimizer {len(self.param_groups)}; build it the same way"
            )
        current = [g["units"] for g in self.param_groups]
        for i, (units, saved) in enumerate(zip(current, state_dict["param_groups"])):
            saved_units = saved.get("units")
            if saved_units is not None and [_plain(u) for u in saved_units] != [
                _plain(u) for u in units
            ]:
                raise ValueError(
                    f"Muon.load_state_dict: param group {i} was saved with other unit layouts "
                    f"than this model declares; rebuild the optimizer from the same model "
                    f"definition as the checkpoint"
                )
        super().load_state_dict(state_dict)
        for group, units in zip(self.param_groups, current):
            group["units"] = units
            # A torch.optim.Muon checkpoint names the lr rule adjust_lr_fn and lacks ns_dtype.
            if "adjust_lr" not in group and "adjust_lr_fn" in group:
                group["adjust_lr"] = group["adjust_lr_fn"] or "original"
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        self.skipped_steps = skipped

    @staticmethod
    def _labels(group: dict[str, Any], gi: int) -> list[str]:
        names = group.get("param_names")
        if names is not None:
            return list(names)
        return [f"parameter {i} of group {gi}" for i in range(len(group["params"]))]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        live = []  # (group, params, grads, units) for params that have gradients
        named_grads = []
        for gi, group in enumerate(self.param_groups):
            params, grads, units = [], [], []
            for p, u, label in zip(group["params"], group["units"], self._labels(group, gi)):
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(
                        f"Muon: {label} has a sparse gradient; Muon needs dense matrices "
                        f"(use a dense embedding, or optimize it with AdamW)"
                    )
                params.append(p)
                grads.append(p.grad)
                units.append(u)
                named_grads.append((label, p.grad))
            if params:
                live.append((group, params, grads, units))

        if self.nonfinite != "ignore":
            bad = nonfinite_names(named_grads)
            if bad:
                if self.nonfinite == "skip":
                    self.skipped_steps += 1
                    return loss
                raise FloatingPointError(
                    f"Muon: non-finite gradient in {len(bad)} parameter(s), e.g. {bad[:3]}; "
                    f"find the cause (lr too high? a bad batch?) or construct the optimizer "
                    f"with nonfinite='skip' to skip such steps"
                )

        buckets: dict[tuple, list[tuple[Tensor, Tensor, float]]] = defaultdict(list)
        for group, params, grads, units in live:
            bufs = []
            for p, g in zip(params, grads):
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(
                        g, memory_format=torch.preserve_format
                    )
                bufs.append(state["momentum_buffer"])
            mu = group["momentum"]
            torch._foreach_lerp_(bufs, grads, 1 - mu)
            directions = torch._foreach_lerp(grads, bufs, mu) if group["nesterov"] else bufs
            lr = float(group["lr"])
            if group["weight_decay"]:
                torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
            ns_key = (
                group["ns_steps"],
                group["ns_coefficients"],
                group["ns_dtype"],
                group["eps"],
            )
            for p, v, u in zip(params, directions, units):
                for pv, vv in zip(unit_views(p, u), unit_views(v, u)):
                    r, c = pv.shape[-2:]
                    alpha = -lr * unit_scale(r, c, group["adjust_lr"])
                    if r > c:  # tall: orthogonalize on the wide twin, as NS would anyway
                        pv, vv = pv.mT, vv.mT
                    buckets[(min(r, c), max(r, c), *ns_key)].append((pv, vv, alpha))

        for (m, n, steps, coefficients, dtype, eps), items in buckets.items():
            _orthogonalize_bucket(items, m, n, steps, coefficients, resolve_dtype(dtype), eps)
        return loss


def _orthogonalize_bucket(
    items: list[tuple[Tensor, Tensor, float]],
    m: int,
    n: int,
    steps: int,
    coefficients: Coefficients | tuple[float, float, float],
    dtype: torch.dtype,
    eps: float,
) -> None:
    """One batched NS call over every unit of one shape; results written into the params."""
    counts = [vv.shape[0] for _, vv, _ in items]
    stack = torch.empty(sum(counts), m, n, dtype=dtype, device=items[0][1].device)
    start = 0
    for (_, vv, _), k in zip(items, counts):
        stack[start : start + k].copy_(vv)
        start += k
    out = newton_schulz_(stack, steps, coefficients, eps)
    start = 0
    for (pv, _, alpha), k in zip(items, counts):
        pv.add_(out[start : start + k], alpha=alpha)
        start += k


def _plain(units: Units | tuple | list) -> tuple[str, tuple[int, ...]]:
    if isinstance(units, Units):
        return (units.kind, tuple(units.sizes))
    kind, sizes = units
    return (str(kind), tuple(int(s) for s in sizes))


def _check_param(p: Tensor, units: Units | None, label: str) -> Units:
    if not isinstance(p, Tensor):
        raise TypeError(f"Muon: {label} is a {type(p).__name__}, expected a tensor")
    if p.is_complex():
        raise ValueError(
            f"Muon: {label} is complex ({p.dtype}); Muon orthogonalizes real matrices "
            f"(view it as real with torch.view_as_real, or optimize it with AdamW)"
        )
    if p.is_sparse or p.layout != torch.strided:
        raise ValueError(f"Muon: {label} has layout {p.layout}; Muon needs dense (strided) tensors")
    if units is None:
        if p.ndim != 2:
            raise ValueError(
                f"Muon: {label} has shape {tuple(p.shape)} and no declared units; Muon takes "
                f"2-D matrices, or tensors with declared units such as (name, p, Units('experts')) "
                f"for [E, out, in]; optimize vectors and scalars with AdamW"
            )
        units = MATRIX
    if not isinstance(units, Units):
        raise TypeError(f"Muon: units of {label} must be a Units, found {type(units).__name__}")
    if units.kind == "adamw":
        raise ValueError(
            f"Muon: {label} is declared 'adamw'; give it to AdamW (build_optimizer splits them)"
        )
    units.check(p.shape, label)
    return units
