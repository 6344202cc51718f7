"""Natural units: how each parameter splits into the matrices Muon orthogonalizes.

A model declares, per parameter, one `Units` value:

- ``matrix``: the whole 2-D weight is one unit.
- ``rows``: consecutive row blocks of the given sizes (e.g. per attention head, and within a
  head the MLA nope/rope or nope/value parts); each block [size, in] is a unit.
- ``cols``: consecutive column blocks (e.g. o_proj per head); each block [out, size] is a unit.
- ``experts``: a stacked [E, out, in] tensor; each expert's [out, in] matrix is a unit.
- ``adamw``: not a matrix for Muon (embeddings, lm_head, norms, router, biases).

The optimizer reads only this declaration; it never inspects module types.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

UnitKind = Literal["matrix", "rows", "cols", "experts", "adamw"]


@dataclass(frozen=True)
class Units:
    kind: UnitKind
    sizes: tuple[int, ...] = ()  # rows/cols: block sizes along that dim, in order

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))
        if self.kind not in ("matrix", "rows", "cols", "experts", "adamw"):
            raise ValueError(f"unknown unit kind {self.kind!r}")
        if self.kind in ("rows", "cols") and not self.sizes:
            raise ValueError(f"{self.kind} units need block sizes")
        if any(s <= 0 for s in self.sizes):
            raise ValueError(f"unit block sizes must be positive, got {self.sizes}")

    @staticmethod
    def per_head(kind: Literal["rows", "cols"], heads: int, *parts: int) -> Units:
        """Blocks repeating per head, e.g. per_head("rows", H, nope, rope)."""
        return Units(kind, tuple(parts) * heads)

    def check(self, shape: torch.Size | tuple[int, ...], name: str = "parameter") -> None:
        """Raise a clear error if this declaration does not fit a tensor of `shape`."""
        nd = len(shape)
        if self.kind == "adamw":
            return
        if self.kind == "experts":
            if nd != 3:
                raise ValueError(
                    f"{name}: expert units need a [E, out, in] tensor, found shape {tuple(shape)}"
                )
            return
        if nd != 2:
            raise ValueError(
                f"{name}: {self.kind} units need a 2-D tensor, found shape {tuple(shape)}"
            )
        if self.kind == "rows" and sum(self.sizes) != shape[0]:
            raise ValueError(
                f"{name}: row blocks sum to {sum(self.sizes)}, but the tensor has {shape[0]} rows"
            )
        if self.kind == "cols" and sum(self.sizes) != shape[1]:
            raise ValueError(
                f"{name}: column blocks sum to {sum(self.sizes)}, but the tensor has {shape[1]} columns"
            )

    def slices(self, shape: torch.Size | tuple[int, ...]) -> list[tuple[slice | int, ...]]:
        """Index tuples selecting each unit of a tensor of `shape` (in declaration order)."""
        self.check(shape)
        if self.kind == "adamw":
            return []
        if self.kind == "matrix":
            return [(slice(None), slice(None))]
        if self.kind == "experts":
            return [(e, slice(None), slice(None)) for e in range(shape[0])]
        out: list[tuple[slice | int, ...]] = []
        start = 0
        for s in self.sizes:
            sl = slice(start, start + s)
            out.append((sl, slice(None)) if self.kind == "rows" else (slice(None), sl))
            start += s
        return out

    def unit_shapes(self, shape: torch.Size | tuple[int, ...]) -> list[tuple[int, int]]:
        """The [rows, cols] of each unit."""
        self.check(shape)
        if self.kind == "adamw":
            return []
        if self.kind == "matrix":
            return [(shape[0], shape[1])]
        if self.kind == "experts":
            return [(shape[1], shape[2])] * shape[0]
        if self.kind == "rows":
            return [(s, shape[1]) for s in self.sizes]
        return [(shape[0], s) for s in self.sizes]


MATRIX = Units("matrix")
EXPERTS = Units("experts")
ADAMW = Units("adamw")


def param_units(model: nn.Module) -> Iterator[tuple[str, nn.Parameter, Units]]:
    """Every trainable parameter of `model` with its declared units.

    Modules declare units with a method ``param_units() -> dict[local_name, Units]``;
    parameters without a declaration default to ``matrix`` when 2-D and ``adamw`` otherwise.
    Names are the model's fully qualified parameter names (stable under FSDP2).
    """
    declared: dict[str, Units] = {}
    for mname, module in model.named_modules():
        if callable(getattr(type(module), "param_units", None)):
            for local, units in module.param_units().items():
                declared[f"{mname}.{local}" if mname else local] = units
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        units = declared.get(name)
        if units is None:
            units = MATRIX if p.ndim == 2 else ADAMW
        units.check(p.shape, name)
        yield name, p, units
