"""MuonClip's QK-clip (Kimi K2): cap each head's attention logits by rescaling its q/k weights.

After an optimizer step, for every attention head h whose recorded max logit S_h exceeded tau:

    gamma_h = tau / S_h
    MLA:  q nope rows  *= sqrt(gamma_h)   (q_b_proj or q_proj)
          k nope rows  *= sqrt(gamma_h)   (kv_b_proj; the value rows are untouched)
          q rope rows  *= gamma_h
          shared rope key (kv_a_proj_with_mqa rope rows): untouched, it is shared by all heads

Every logit of the head is q_nope . k_nope + q_rope . k_rope (times the softmax scale), so it
is multiplied by exactly gamma_h: the max logit on the same input becomes tau.

Attention modules are found by what they declare, not their type: a `max_logit` tensor [H]
(recorded when `record_max_logit` is True) and per-head row units (nope, rope) on
`q_b_proj.weight` / `q_proj.weight` and (nope, v) on `kv_b_proj.weight`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from cadenza.model.units import Units


@dataclass
class QKClipStats:
    max_logit: float  # largest recorded logit over all heads (before clipping)
    clipped_heads: int  # heads rescaled this step


def clip_gammas(max_logit: Tensor, tau: float) -> Tensor:
    """gamma_h = min(1, tau / S_h) per head (1 where S_h <= tau or is not finite-positive)."""
    s = max_logit.float()
    return torch.where(s > tau, tau / s, torch.ones_like(s))


def mla_row_scales(
    gamma: Tensor, q_parts: tuple[int, int], kv_parts: tuple[int, int]
) -> tuple[Tensor, Tensor]:
    """Row multipliers for the q projection [H (nope + rope)] and kv_b_proj [H (nope + v)]."""
    nope, rope = q_parts
    k_nope, v = kv_parts
    root = gamma.sqrt()[:, None]
    q = torch.cat([root.expand(-1, nope), gamma[:, None].expand(-1, rope)], dim=1)
    kv = torch.cat([root.expand(-1, k_nope), torch.ones_like(root).expand(-1, v)], dim=1)
    return q.reshape(-1), kv.reshape(-1)


def _track_max(module: nn.Module, args, output) -> None:
    m = getattr(module, "max_logit", None)
    if isinstance(m, Tensor):
        prev = getattr(module, "qk_clip_max", None)
        module.qk_clip_max = m if prev is None else torch.maximum(prev, m)


def enable_max_logit(model: nn.Module) -> int:
    """Turn on max-logit recording in every attention module; returns how many.

    A forward hook keeps the running max since the last clip in `qk_clip_max`, so with
    gradient accumulation every micro-batch counts, not only the last one.
    """
    n = 0
    for m in model.modules():
        if hasattr(m, "record_max_logit"):
            m.record_max_logit = True
            if not getattr(m, "_qk_clip_hooked", False):
                m.register_forward_hook(_track_max)
                m._qk_clip_hooked = True
            n += 1
    return n


def _head_parts(units: Units, name: str, heads: int) -> tuple[int, int]:
    if units.kind != "rows" or len(units.sizes) != 2 * heads:
        raise ValueError(
            f"qk_clip: {name} should declare per-head row units (2 blocks per head for "
            f"{heads} heads), found {units}"
        )
    return units.sizes[0], units.sizes[1]


@torch.no_grad()
def apply_qk_clip(model: nn.Module, tau: float = 100.0) -> QKClipStats:
    """Rescale q/k weights of every head whose recorded max logit exceeds `tau`.

    Uses the running max since the last clip (`qk_clip_max`, see `enable_max_logit`), else the
    last recorded `max_logit`, and consumes it (sets it to None) so a stale value is never
    applied twice.
    """
    top, clipped = float("-inf"), 0
    for mname, module in model.named_modules():
        max_logit = getattr(module, "qk_clip_max", None)
        if max_logit is None:
            max_logit = getattr(module, "max_logit", None)
        if not isinstance(max_logit, Tensor):
            continue
        module.max_logit = None
        module.qk_clip_max = None
        top = max(top, float(max_logit.max()))
        gamma = clip_gammas(max_logit, tau)
        n = int((gamma < 1).sum())
        if n == 0:
            continue
        units = module.param_units()
        q_name = "q_b_proj.weight" if "q_b_proj.weight" in units else "q_proj.weight"
        if q_name not in units or "kv_b_proj.weight" not in units:
            raise ValueError(
                f"qk_clip: {mname or 'model'} records max_logit but declares neither "
                f"q_b_proj.weight/q_proj.weight nor kv_b_proj.weight; QK-clip supports MLA"
            )
        heads = max_logit.shape[0]
        q_scale, kv_scale = mla_row_scales(
            gamma,
            _head_parts(units[q_name], q_name, heads),
            _head_parts(units["kv_b_proj.weight"], "kv_b_proj.weight", heads),
        )
        q_w = module.get_parameter(q_name)
        kv_w = module.get_parameter("kv_b_proj.weight")
        q_w.mul_(q_scale.to(q_w.dtype)[:, None])
        kv_w.mul_(kv_scale.to(kv_w.dtype)[:, None])
        clipped += n
    return QKClipStats(max_logit=top, clipped_heads=clipped)
