"""Rotary position embedding with YaRN context extension, as DeepSeek-V3 / Kimi K2 use it.

Plain RoPE rotates pair j of the rotary dims by angle p * theta^(-2j/d) at position p.
YaRN (Peng et al. 2023) blends per frequency between the original ("extrapolated") and the
position-interpolated (divided by `factor`) inverse frequencies:

    inv_freq_j = inv_interp_j * ramp_j + inv_extrap_j * (1 - ramp_j),
    ramp_j = clamp((j - low) / (high - low), 0, 1),

with [low, high] the dims whose wavelength completes beta_fast..beta_slow rotations within
the original context. cos/sin are scaled by the attention factor

    m(s, a) = 0.1 * a * ln(s) + 1 (s > 1, else 1);  attention_factor = m(s, mscale) / m(s, mscale_all_dim)

and the softmax scale 1/sqrt(d_qk) is multiplied by m(s, mscale_all_dim)^2 (see `softmax_scale`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from cadenza.config.model import ModelConfig, RopeScaling


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(
    dim: int, theta: float, scaling: RopeScaling, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim // 2] (fp32) and the cos/sin scale for `dim` rotary dims."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    pos_freqs = theta**exponents
    if scaling.type == "none":
        return 1.0 / pos_freqs, 1.0
    s = scaling.factor
    if scaling.attention_factor is not None:
        attention_factor = scaling.attention_factor
    elif scaling.mscale and scaling.mscale_all_dim:
        attention_factor = yarn_mscale(s, scaling.mscale) / yarn_mscale(s, scaling.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(s)
    original = scaling.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast or 32), correction_dim(scaling.beta_slow or 1)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (s * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolate
    return inv_freq, attention_factor


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(d_qk), times m(factor, mscale_all_dim)^2 under YaRN (DeepSeek-V3)."""
    scale = cfg.qk_head_dim**-0.5
    r = cfg.rope_scaling
    if r.type != "none" and r.mscale_all_dim:
        m = yarn_mscale(r.factor, r.mscale_all_dim)
        scale = scale * m * m
    return scale


class RotaryEmbedding(nn.Module):
    """Maps positions [..., T] to (cos, sin) [..., T, rope_dim // 2] in fp32."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inv_freq, self.attention_factor = rope_frequencies(
            cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
        )
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self._cfg = cfg

    def reset_parameters(self) -> None:
        """Recompute the (non-persistent) frequencies, e.g. after materializing from meta."""
        cfg = self._cfg
        inv_freq, _ = rope_frequencies(
            cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
        )
        self.inv_freq = nn.Buffer(inv_freq.to(self.inv_freq.device), persistent=False)

    def _apply(self, fn, recurse=True):
        # Keep the frequencies fp32 when the model is cast to bf16: rounded frequencies
        # would shift the angles at large positions.
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32 and self.inv_freq.device.type != "meta":
            self.reset_parameters()
        elif self.inv_freq.dtype != torch.float32:
            self.inv_freq = nn.Buffer(self.inv_freq.float(), persistent=False)
        return self

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions[..., None].float() * self.inv_freq.float()
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool
) -> torch.Tensor:
    """Rotate the last dim of x [..., T, d] by angles with cos/sin [..., T, d // 2].

    Pairs are (x[2j], x[2j+1]) when `interleave` (DeepSeek's checkpoint layout), else
    (x[j], x[j + d/2]). Either way the output lays the rotated pairs out as
    [first elements | second elements]; q and k get the same layout, so q.k is unchanged.
    """
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
