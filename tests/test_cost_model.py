import pytest

from cadenza.model.units import EXPERTS, MATRIX, Units
from cadenza.optim.cost_model import Hardware, predict_step
from cadenza.optim.shard_plan import ns_flops


def test_single_gpu_is_pure_compute():
    hw = Hardware(peak_flops=1e12, ns_efficiency=1.0)
    c = predict_step([((64, 256), MATRIX)], 1, hw)
    assert c.comm_s == pytest.approx(2 * hw.latency_s)  # one bucket, gather + return latency
    assert c.compute_s == pytest.approx(5 * (4 * 64 * 64 * 256 + 2 * 64**3) / 1e12)


def test_experts_on_expert_dim_move_no_bytes_and_split_compute():
    hw = Hardware(peak_flops=1e12, ns_efficiency=1.0)
    params = [((16, 32, 48), EXPERTS)]
    c = predict_step(params, 8, hw)  # ep = 8: two whole experts per GPU
    assert c.groups["expert"].bytes_max == 0
    assert c.compute_s == pytest.approx(2 * ns_flops(32, 48) / 1e12)


def test_row_sharded_heads_move_what_the_lower_bound_says():
    hw = Hardware(peak_flops=1e12, ns_efficiency=1.0, intra_node_bw=1e9)
    # 4 heads of 6 rows over 8 ranks: chunks of 3 rows, each head split in two halves.
    params = [((24, 10), Units.per_head("rows", 4, 6))]
    c = predict_step(params, 8, hw, elem_bytes=4)
    g = c.groups["dense"]
    assert g.total_bytes == g.lower_bound_bytes == 4 * (2 * 3 * 10) * 4
