"""RL trainer: kill -9 / SIGTERM mid-run and resume equals an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from cadenza.config import ConfigError, load_config
from cadenza.train.rl_trainer import CKPT_NAME, run_rl_job

ARGS = [
    "train.mode=rl",
    "train.steps=8",
    "train.ckpt_every=3",
    "train.threads=1",
    "rl.tasks_per_step=4",
    "rl.group_size=4",
    "rl.warmup_steps=5",
]

CHILD = """
import sys, time
import torch
torch.set_num_threads(1)
from cadenza.config import ConfigError, load_config
from cadenza.train.pretrain import Interrupted
from cadenza.train.rl_trainer import run_rl_job
cfg = load_config("tiny", sys.argv[1:])
try:
    run_rl_job(cfg, quiet=True, on_step=lambda m: time.sleep(0.3))
except Interrupted as e:
    sys.exit(128 + e.signum)
"""


def _cfg(out, *extra):
    return load_config("tiny", [*ARGS, f"train.out_dir={out}", *extra])


def _metrics(out):
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r.pop("step_time_s")
    return rows


def _weights(out):
    return torch.load(out / CKPT_NAME, weights_only=False)["model"]


def _start_child(out):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, *ARGS, f"train.out_dir={out}"],
        env=env,
        stderr=subprocess.PIPE,
    )


def _wait_for_lines(out, n, proc, timeout=120):
    path = out / "metrics.jsonl"
    t0 = time.time()
    while time.time() - t0 < timeout:
        if path.is_file() and len(path.read_text().splitlines()) >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(proc.stderr.read().decode())
        time.sleep(0.05)
    raise AssertionError("child made no progress")


@pytest.mark.slow
def test_kill9_and_sigterm_then_resume_equal_uninterrupted(tmp_path):
    torch.set_num_threads(1)
    ref = tmp_path / "ref"
    run_rl_job(_cfg(ref), quiet=True)
    first = _metrics(ref)[0]
    assert first["self_test"] == {"kl": 0.0, "grad": 0.0}  # empty hint on a real episode
    assert first["hint_spans"] > 0 and first["hinted_by_provider"]["unknown_tool"] > 0

    killed = tmp_path / "killed"
    proc = _start_child(killed)
    _wait_for_lines(killed, 5, proc)  # checkpoint at step 3, steps 3-4 past it
    proc.kill()
    proc.wait()
    assert len(_metrics(killed)) >= 5
    run_rl_job(_cfg(killed, "train.resume=true"), quiet=True)

    assert _metrics(killed) == _metrics(ref)
    a, b = _weights(killed), _weights(ref)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k

    termed = tmp_path / "termed"
    proc = _start_child(termed)
    _wait_for_lines(termed, 2, proc)
    proc.send_signal(signal.SIGTERM)
    # finishes the step in flight, checkpoints, exits as the CLI would (128 + SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    done = len(_metrics(termed))
    assert done < 8
    assert torch.load(termed / CKPT_NAME, weights_only=False)["step"] == done
    run_rl_job(_cfg(termed, "train.resume=true"), quiet=True)
    assert _metrics(termed) == _metrics(ref)
    for k, v in _weights(termed).items():
        assert torch.equal(v, b[k]), k


@pytest.mark.slow
def test_cli_train_mode_rl(tmp_path):
    out = tmp_path / "cli"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "cadenza.cli.main",
            "train",
            *ARGS[:-1],
            "train.steps=2",
            "rl.warmup_steps=2",
            f"train.out_dir={out}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert r.returncode == 0, r.stderr
    assert [m["step"] for m in _metrics(out)] == [1, 2]
    with pytest.raises(ConfigError, match=r"rl.env: expected one of \['toy', 'agent'\]"):
        load_config("tiny", ["train.mode=rl", "rl.env=nope"])
