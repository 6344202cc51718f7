"""Dense SwiGLU MLP: down(silu(gate(x)) * up(x)). Used by the first dense layers and as the
MoE's shared experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cadenza.model.units import MATRIX, Units


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def param_units(self) -> dict[str, Units]:
        return {f"{n}.weight": MATRIX for n in ("gate_proj", "up_proj", "down_proj")}
