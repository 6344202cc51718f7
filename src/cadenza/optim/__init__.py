"""cadenza.optim: Muon at natural-unit granularity, Newton-Schulz, AdamW pairing, schedules."""

from cadenza.optim.build import ModelOptimizer, build_optimizer
from cadenza.optim.muon import Muon, muon_direction, muon_unit_update, unit_scale, unit_views
from cadenza.optim.newton_schulz import newton_schulz, ns_flops

__all__ = [
    "ModelOptimizer",
    "Muon",
    "build_optimizer",
    "muon_direction",
    "muon_unit_update",
    "newton_schulz",
    "ns_flops",
    "unit_scale",
    "unit_views",
]
