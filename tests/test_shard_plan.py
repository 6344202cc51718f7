import itertools

import pytest
import torch

from cadenza.model.units import EXPERTS, MATRIX, Units
from cadenza.optim.shard_plan import (
    Box,
    ShardSpec,
    chunk_range,
    local_box,
    make_plan,
    ns_flops,
    unit_boxes,
)


@pytest.mark.parametrize("size,n", [(10, 4), (7, 3), (3, 4), (0, 2), (16, 8), (5, 8)])
def test_chunk_range_matches_torch_chunk(size, n):
    chunks = torch.arange(size).chunk(n) if size else ()
    for i in range(n):
        a, b = chunk_range(size, n, i)
        expect = chunks[i].tolist() if i < len(chunks) else []
        assert list(range(a, b)) == expect


def test_nested_shards_match_nested_chunks():
    # Shard(0) over an outer mesh dim of 2 then an inner one of 3, on 11 rows.
    t = torch.arange(11 * 4).reshape(11, 4)
    for i, j in itertools.product(range(2), range(3)):
        outer = t.chunk(2)[i]
        inner = outer.chunk(3)
        want = inner[j] if j < len(inner) else outer[:0]
        box = local_box((11, 4), [ShardSpec(0, 2, i), ShardSpec(0, 3, j)])
        got = t[tuple(slice(a, b) for a, b in zip(box.start, box.stop))]
        assert torch.equal(got, want)


def _assemble_check(plan, shapes):
    """Every sharded unit's pieces are disjoint and cover it exactly."""
    for w in plan.units:
        if w.replicated:
            continue
        cover = torch.zeros(shapes[w.param], dtype=torch.int32)
        for piece in w.pieces.values():
            cover[tuple(slice(a, b) for a, b in zip(piece.start, piece.stop))] += 1
        inside = cover[tuple(slice(a, b) for a, b in zip(w.box.start, w.box.stop))]
        assert torch.all(inside == 1)


def test_awkward_rows_head_blocks_split_and_empty_shard():
    # 3 heads of (5 nope + 2 rope) rows = 21 rows over 4 ranks: chunks of 6,6,6,3 rows,
    # so head blocks straddle shard boundaries; 2 rows over 4 ranks leaves empty shards.
    shapes = [(21, 8), (2, 8), (4, 6, 5)]
    units = [Units.per_head("rows", 3, 5, 2), MATRIX, EXPERTS]
    world = 4
    specs = [[[ShardSpec(0, world, r)] for r in range(world)] for _ in shapes]
    plan = make_plan(shapes, units, specs, world)
    _assemble_check(plan, shapes)
    assert plan.local_boxes[1][2].numel == 0 and plan.local_boxes[1][3].numel == 0
    split = [w for w in plan.units if len(w.pieces) > 1]
    assert split, "some head block must straddle two ranks"
    # Experts sharded on E, one per rank: owners are the holders, nothing moves for them.
    for w in plan.units:
        if w.param == 2:
            assert list(w.pieces) == [w.owner]
    b = next(b for b in plan.buckets if b.shape == (6, 5))
    assert all(plan.send_counts(b, r)[s] == 0 for r in range(world) for s in range(world) if s != r)


def test_expert_shard_on_expert_dim_sends_nothing():
    shapes = [(8, 12, 16)] * 3
    world = 4
    specs = [[[ShardSpec(0, world, r)] for r in range(world)] for _ in shapes]
    plan = make_plan(shapes, [EXPERTS] * 3, specs, world)
    assert plan.total_bytes(4) == 0 == plan.lower_bound_bytes(4)
    assert plan.load_balance() == pytest.approx(1.0)


def test_bytes_near_lower_bound_and_balanced_on_k2_miniature():
    # Attention-like row/col blocks and experts sharded on rows (not on E) over 8 ranks.
    H, nope, rope, v, lora, hid, E, I = 6, 24, 12, 24, 40, 96, 16, 40
    shapes = [
        (H * (nope + rope), lora),
        (H * (nope + v), lora),
        (hid, H * v),
        (E, I, hid),
        (E, hid, I),
    ]
    units = [
        Units.per_head("rows", H, nope, rope),
        Units.per_head("rows", H, nope, v),
        Units.per_head("cols", H, v),
        EXPERTS,
        EXPERTS,
    ]
    world = 8
    specs = [[[ShardSpec(0, world, r)] for r in range(world)] for _ in shapes]
    plan = make_plan(shapes, units, specs, world)
    _assemble_check(plan, shapes)
    lb = plan.lower_bound_bytes(4)
    assert plan.total_bytes(4) <= 1.1 * lb
    assert plan.load_balance() <= 1.1


def test_replicated_params_are_local_work():
    shapes = [(6, 4)]
    specs = [[[] for _ in range(2)]]
    plan = make_plan(shapes, [MATRIX], specs, 2)
    assert plan.units[0].replicated and plan.total_bytes(4) == 0


def test_unit_boxes_and_ns_flops():
    boxes = unit_boxes((4, 9), Units("cols", (4, 5)))
    assert boxes == [Box((0, 0), (4, 4)), Box((0, 4), (4, 9))]
    assert ns_flops(3, 8, 1) == 4 * 9 * 8 + 2 * 27 == ns_flops(8, 3, 1)
