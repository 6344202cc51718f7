"""`cadenza bench muon` runs end to end (a smoke test; figures are not asserted)."""

from __future__ import annotations

import pytest

from cadenza.bench import muon as bench


@pytest.mark.slow
def test_bench_muon_smoke(capsys):
    out = bench.run(["--sets", "tiny", "--repeats", "1", "--matmul-n", "64", "--threads", "1"])
    tiny = out["sets"]["tiny"]
    assert out["matmul_gflops"] > 0 and tiny["ns_gflops"] > 0 and tiny["step_ratio_vs_torch"] > 0
    assert tiny["units"] == sum(bench.unit_shape_counts(bench.tiny_model()).values())
    assert "torch.optim.Muon" in capsys.readouterr().out
