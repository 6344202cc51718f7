import pytest
import torch
from torch import nn

from cadenza.model.units import ADAMW, EXPERTS, Units, param_units


def test_row_blocks_per_head_cover_the_tensor():
    u = Units.per_head("rows", 3, 5, 2)  # e.g. MLA nope=5, rope=2 per head
    w = torch.arange(21 * 4.0).reshape(21, 4)
    blocks = [w[s] for s in u.slices(w.shape)]
    assert [tuple(b.shape) for b in blocks] == [(5, 4), (2, 4)] * 3
    assert torch.equal(torch.cat(blocks, 0), w)
    assert u.unit_shapes(w.shape) == [(5, 4), (2, 4)] * 3


def test_col_and_expert_units():
    w = torch.randn(6, 8)
    u = Units.per_head("cols", 2, 4)
    assert torch.equal(torch.cat([w[s] for s in u.slices(w.shape)], 1), w)
    e = torch.randn(3, 4, 5)
    assert [tuple(e[s].shape) for s in EXPERTS.slices(e.shape)] == [(4, 5)] * 3


def test_mismatched_declaration_is_a_clear_error():
    with pytest.raises(ValueError, match="row blocks sum to 6, but the tensor has 7 rows"):
        Units("rows", (3, 3)).check((7, 2), "q_b_proj")
    with pytest.raises(ValueError, match="expert units need"):
        EXPERTS.check((4, 4))


def test_param_units_reads_module_declarations():
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(4, 6, bias=False)
            self.norm = nn.LayerNorm(4)

        def param_units(self):
            return {"q.weight": Units.per_head("rows", 2, 3), "norm.weight": ADAMW}

    m = nn.Sequential(Attn(), nn.Linear(6, 6))
    got = {n: u for n, _, u in param_units(m)}
    assert got["0.q.weight"] == Units("rows", (3, 3))
    assert got["0.norm.weight"].kind == "adamw" and got["0.norm.bias"].kind == "adamw"
    assert got["1.weight"].kind == "matrix" and got["1.bias"].kind == "adamw"
