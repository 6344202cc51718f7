"""`build_optimizer(model, config)`: Muon over unit-declared matrices, AdamW over the rest.

One object with step(), zero_grad(), state_dict(), load_state_dict(). Each step:
non-finite check over all gradients (error or counted skip), set learning rates from the
schedule, Muon step, AdamW step, then QK-clip if enabled.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from cadenza.config.job import Config
from cadenza.config.optim import OptimConfig
from cadenza.model.units import param_units
from cadenza.optim.muon import Muon, nonfinite_names
from cadenza.optim.qk_clip import QKClipStats, apply_qk_clip, enable_max_logit
from cadenza.optim.schedule import lr_factor
from cadenza.optim.sharded import ShardedMuon


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ModelOptimizer:
    """Muon + AdamW for one model, a shared lr schedule and optional QK-clip."""

    def __init__(self, model: nn.Module, cfg: OptimConfig, total_steps: int):
        self.model, self.cfg, self.total_steps = model, cfg, max(1, total_steps)
        self.steps = 0  # optimizer steps taken (skipped ones excluded)
        self.skipped_steps = 0
        self.last_qk_clip: QKClipStats | None = None
        muon, decay, no_decay = [], [], []
        for name, p, units in param_units(model):
            if units.kind == "adamw" or cfg.optimizer == "adamw":
                (decay if p.ndim >= 2 else no_decay).append((name, p))
            else:
                muon.append((name, p, units))
        # Parameters sharded by cadenza.parallel (DTensors) get the sharded optimizer, which
        # equals Muon on the full tensors.
        sharded = any(isinstance(p, DTensor) for _, p, _ in muon)
        muon_cls = ShardedMuon if sharded else Muon
        extra = {"bucket_numel": cfg.bucket_numel} if sharded else {}
        self.muon = (
            muon_cls(
                muon,
                **extra,
                lr=cfg.lr,
                momentum=cfg.momentum,
                nesterov=cfg.nesterov,
                weight_decay=cfg.weight_decay,
                adjust_lr=cfg.adjust_lr,
                ns_steps=cfg.ns_steps,
                ns_coefficients=cfg.ns_coefficients,
                ns_dtype=cfg.ns_dtype,
                nonfinite="ignore",  # checked here, over all parameters at once
            )
            if muon
            else None
        )
        groups = [
            {"params": ps, "weight_decay": wd}
            for ps, wd in ((decay, cfg.adamw_weight_decay), (no_decay, 0.0))
            if ps
        ]
        self.adamw = (
            torch.optim.AdamW(
                groups, lr=cfg.adamw_lr, betas=(cfg.adamw_beta1, cfg.adamw_beta2), eps=cfg.adamw_eps
            )
            if groups
            else None
        )
        for opt in self.optimizers:
            for g in opt.param_groups:
                g["base_lr"] = g["lr"]
        if cfg.qk_clip:
            enable_max_logit(model)
        self._set_lr()

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.muon, self.adamw) if o is not None]

    def named_params(self) -> dict[str, list[str]]:
        """Which parameter names each optimizer holds (for logs and tests)."""
        return {
            kind: [n for g in opt.param_groups for n in g["param_names"]]
            for kind, opt in (("muon", self.muon), ("adamw", self.adamw))
            if opt is not None
        }

    def lr_factor(self, step: int | None = None) -> float:
        c = self.cfg
        return lr_factor(
            self.steps if step is None else step,
            self.total_steps,
            c.schedule,
            c.warmup_steps,
            c.min_lr_ratio,
            c.decay_fraction,
        )

    @property
    def lrs(self) -> dict[str, float]:
        out = {}
        if self.muon is not None:
            out["muon"] = self.muon.param_groups[0]["lr"]
        if self.adamw is not None:
            out["adamw"] = self.adamw.param_groups[0]["lr"]
        return out

    def _set_lr(self) -> None:
        f = self.lr_factor()
        for opt in self.optimizers:
            for g in opt.param_groups:
                g["lr"] = g["base_lr"] * f

    @torch.no_grad()
    def step(self) -> bool:
        """One optimizer step; returns False if it was skipped for non-finite gradients."""
        named = [
            (n, p.grad)
            for opt in self.optimizers
            for g in opt.param_groups
            for n, p in zip(g["param_names"], g["params"])
            if p.grad is not None
        ]
        bad = nonfinite_names([(n, _local(g)) for n, g in named])
        if (
            dist.is_available()
            and dist.is_initialized()
            and any(isinstance(g, DTensor) for _, g in named)
        ):
            # Every rank must take the same decision, whichever rank saw the bad value.
            flag = torch.tensor([float(bool(bad))])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() and not bad:
                bad = ["(a parameter shard on another rank)"]
        if bad:
            if self.cfg.nonfinite == "skip":
                self.skipped_steps += 1
                return False
            raise FloatingPointError(
                f"non-finite gradient in {len(bad)} parameter(s), e.g. {bad[:3]}; lower the "
                f"learning rate or check the batch, or set optim.nonfinite=skip to skip such steps"
            )
        self._set_lr()
        for opt in self.optimizers:
            opt.step()
        if self.cfg.qk_clip:
            self.last_qk_clip = apply_qk_clip(self.model, self.cfg.qk_clip_tau)
        self.steps += 1
        self._set_lr()
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "muon": self.muon.state_dict() if self.muon is not None else None,
            "adamw": self.adamw.state_dict() if self.adamw is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, opt in (("muon", self.muon), ("adamw", self.adamw)):
            if (state.get(key) is None) != (opt is None):
                raise ValueError(
                    f"optimizer state: the checkpoint {'has' if state.get(key) else 'lacks'} "
                    f"{key} state but this model/config {'lacks' if opt is None else 'has'} "
                    f"{key} parameters; resume with the same model and optim.optimizer"
                )
            if opt is not None:
                opt.load_state_dict(state[key])
        self.restore_counters(int(state["steps"]), int(state.get("skipped_steps", 0)))

    def restore_counters(self, steps: int, skipped_steps: int = 0) -> None:
        """Set the step counters (the schedule position) after the moments were loaded, e.g.
        by torch.distributed.checkpoint, which restores each optimizer but not this wrapper."""
        self.steps = int(steps)
        self.skipped_steps = int(skipped_steps)
        # base lrs come from the config of this run, not the checkpoint's schedule position.
        for opt in self.optimizers:
            for g in opt.param_groups:
                g["base_lr"] = self.cfg.adamw_lr if opt is self.adamw else self.cfg.lr
        self._set_lr()


def build_optimizer(
    model: nn.Module, config: Config | OptimConfig, total_steps: int | None = None
) -> ModelOptimizer:
    """Muon over the model's unit-declared matrices, AdamW over `adamw` units.

    `config` is the job Config (uses .optim, and .train.steps for the schedule length) or an
    OptimConfig (then pass `total_steps`, default 1000).
    """
    if isinstance(config, Config):
        return ModelOptimizer(model, config.optim, total_steps or config.train.steps)
    if isinstance(config, OptimConfig):
        return ModelOptimizer(model, config, total_steps or 1000)
    raise TypeError(
        f"build_optimizer: expected a Config or OptimConfig, found {type(config).__name__}"
    )
