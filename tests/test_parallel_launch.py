"""Launch under torchrun: `python -m cadenza.parallel` joins torchrun's gloo group, builds the
meshes from `parallel.*` overrides and matches a one-process step (its own oracle is the
unparallelized model on the whole batch); a bad layout exits 2 naming the rule."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={nproc}", "-m", "cadenza.parallel", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_launch_cp_and_ep_on_gloo():
    small = ["model.num_hidden_layers=2", "model.vocab_size=256", "model.hidden_size=64"]
    run = _torchrun(2, "parallel.cp=2", "parallel.ep=2", "parallel.expert_shard=1", *small)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "2 ranks (gloo)" in run.stdout and "-> OK" in run.stdout
    assert "cp             [[0, 1]]" in run.stdout


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_bad_layout_exits_with_the_rule():
    run = _torchrun(2, "parallel.ep=3", "model.num_hidden_layers=2")
    assert run.returncode != 0
    assert "expert: replicate x shard x ep = world size" in run.stderr


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_a_failing_rank_ends_the_job_with_its_error():
    import time

    t0 = time.monotonic()
    run = _torchrun(2, "--fail-on-rank=1", "model.num_hidden_layers=2", "model.vocab_size=256")
    assert run.returncode != 0
    assert "failure drill on rank 1" in run.stdout + run.stderr
    assert time.monotonic() - t0 < 120  # rank 0, blocked in a collective, did not hang
