"""RMSNorm: y = w * x / sqrt(mean(x^2) + eps), computed in fp32 whatever the input dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cadenza.model.units import ADAMW, Units


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        # Cast back before the weight multiply, as the reference implementation does.
        return self.weight * x.to(dtype)

    def param_units(self) -> dict[str, Units]:
        return {"weight": ADAMW}

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
