from cadenza.bench.muon_vs_adamw import smooth, steps_to_reach


def test_smooth_is_a_trailing_moving_average():
    assert smooth([4.0, 2.0, 6.0, 0.0], 2) == [4.0, 3.0, 4.0, 3.0]
    assert smooth([1.0, 2.0, 3.0], 1) == [1.0, 2.0, 3.0]


def test_steps_to_reach_is_one_based_first_hit():
    assert steps_to_reach([5.0, 4.0, 3.0, 2.0], 3.5) == 3
    assert steps_to_reach([5.0, 4.0], 1.0) is None
