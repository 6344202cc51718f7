"""`cadenza train` under torchrun on 4 gloo processes with the dual meshes (dense shard=2 x
cp=2, experts ep=4) and sharded Muon, checkpointed with DCP.

Oracle: the single-process job on the same config and seed (tests/test_pretrain.py checks
that one against transformers and against its own uninterrupted runs); transformers loads
the final checkpoint.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cadenza.config import load_config
from cadenza.log.metrics import read_jsonl
from cadenza.model.tokenizer import train_tokenizer
from cadenza.train.checkpoint import list_checkpoints
from cadenza.train.corpus import corpus_files
from cadenza.train.pretrain import PretrainError, pretrain
from test_pretrain import TINY_MODEL_AND_DATA

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 6
TINIER = [
    *TINY_MODEL_AND_DATA,
    f"train.steps={STEPS}",
    "optim.warmup_steps=2",
    "optim.lr=0.01",
    "optim.adamw_lr=0.01",
    # fp32 Newton-Schulz: sharded Muon then equals Muon to rounding, not to bf16 flips
    "optim.ns_dtype=float32",
    "train.log_every=1",
    "train.eval_every=3",
    "train.ckpt_every=3",
    "train.keep_checkpoints=0",
    "train.threads=1",
    "train.sample_tokens=8",
]
DUAL_MESH = ["parallel.shard=2", "parallel.cp=2", "parallel.ep=4", "parallel.expert_shard=1"]


def _overrides(tokenizer_path, out_dir, *extra):
    return [*TINIER, f"tokenizer.path={tokenizer_path}", f"train.out_dir={out_dir}", *extra]


def _torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={nproc}", "-m", "cadenza.cli.main", "train", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)


def _records(out_dir):
    return read_jsonl(Path(out_dir) / "metrics.jsonl")


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    files = corpus_files("stdlib", max_bytes=600_000)
    return str(train_tokenizer(files, vocab_size=512, max_bytes=600_000).save(d))


@pytest.fixture(scope="module")
def single(tokenizer_path, tmp_path_factory):
    """The oracle: the same job in this process."""
    out = tmp_path_factory.mktemp("single")
    pretrain(load_config("tiny", _overrides(tokenizer_path, out)), log=lambda m: None)
    return out


@pytest.fixture(scope="module")
def dual_mesh(tokenizer_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("dual")
    run = _torchrun(4, *_overrides(tokenizer_path, out), *DUAL_MESH)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return out, run


def _assert_losses_match(got_dir, want_dir, tol):
    got, want = _records(got_dir), _records(want_dir)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for g, w in zip(got, want):
        assert abs(g["loss"] - w["loss"]) <= tol, (g["step"], g["loss"], w["loss"])
        assert abs(g.get("val_loss", 0.0) - w.get("val_loss", 0.0)) <= tol, g["step"]
        assert abs(g["grad_norm"] - w["grad_norm"]) <= 10 * tol, g["step"]


def test_dual_mesh_run_matches_the_single_process_run(dual_mesh, single):
    out, run = dual_mesh
    _assert_losses_match(out, single, tol=1e-4)
    assert run.stdout.count("resuming") == 0 and "4 ranks" in run.stdout
    assert run.stdout.count("done: step 6") == 1  # rank 0 alone reports
    assert (out / "sample.txt").read_text().startswith("def fibonacci(n):")
    assert [s for s, _ in list_checkpoints(out)] == [3, 6]


def test_final_checkpoint_loads_in_transformers(dual_mesh, single):
    from transformers import AutoModelForCausalLM

    from cadenza.model import from_pretrained

    ckpt = list_checkpoints(dual_mesh[0])[-1][1]
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    oracle = from_pretrained(list_checkpoints(single)[-1][1]).eval()
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = hf(ids).logits
        want = oracle(ids)
    torch.testing.assert_close(got, getattr(want, "logits", want), atol=1e-3, rtol=1e-3)


def test_resume_on_another_layout_continues_the_run(dual_mesh, single, tokenizer_path, tmp_path):
    """Saved on 4 ranks (shard=2 x cp=2, ep=4), resumed on 2 (ep=2) from step 3."""
    out = tmp_path / "resumed"
    shutil.copytree(dual_mesh[0], out)
    shutil.rmtree(out / "checkpoints" / f"step_{STEPS:08d}")
    run = _torchrun(
        2, "--resume", *_overrides(tokenizer_path, out), "parallel.ep=2", "parallel.expert_shard=1"
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"resuming from {out / 'checkpoints' / 'step_00000003'} (step 3)" in run.stdout
    _assert_losses_match(out, dual_mesh[0], tol=1e-5)
    _assert_losses_match(out, single, tol=1e-4)


def test_checkpoint_kinds_are_not_mixed_up(dual_mesh, single, tokenizer_path, tmp_path):
    cfg = load_config("tiny", _overrides(tokenizer_path, dual_mesh[0], "train.resume=true"))
    with pytest.raises(PretrainError, match="written by a distributed run .* under torchrun"):
        pretrain(cfg)
    run = _torchrun(2, "--resume", *_overrides(tokenizer_path, single), "parallel.ep=2")
    assert run.returncode != 0
    assert "written by a single-process run; resume it in one process" in run.stderr


def test_sigterm_to_torchrun_checkpoints_on_every_rank_then_resumes(tokenizer_path, tmp_path):
    """torchrun forwards SIGTERM; the ranks agree on the step, save it, and a resume ends."""
    import signal
    import time

    steps = ["train.steps=20", "train.ckpt_every=100", "train.eval_every=100"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    cmd += ["-m", "cadenza.cli.main", "train", *_overrides(tokenizer_path, tmp_path), *steps]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [*cmd, *DUAL_MESH], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    metrics, t0 = tmp_path / "metrics.jsonl", time.monotonic()
    while not (metrics.is_file() and len(read_jsonl(metrics)) >= 3):
        assert proc.poll() is None, proc.communicate()
        if time.monotonic() - t0 > 150:
            proc.kill()
            pytest.fail("timed out waiting for step 3")
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert err.count("stopped by SIGTERM after step") == 1, err[-3000:]  # rank 0 alone says it
    ((stopped, path),) = list_checkpoints(tmp_path)
    assert 3 <= stopped < 20 and (path / "dcp" / ".metadata").is_file()
    assert len(_records(tmp_path)) == stopped

    run = _torchrun(
        2, "--resume", *_overrides(tokenizer_path, tmp_path), *steps,
        "parallel.ep=2", "parallel.expert_shard=1",
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert [r["step"] for r in _records(tmp_path)] == list(range(1, 21))
    assert list_checkpoints(tmp_path)[-1][0] == 20


def test_a_batch_that_does_not_split_over_the_layout_is_refused():
    from types import SimpleNamespace

    from cadenza.parallel import check_layout
    from cadenza.train.distributed import LayoutMismatch, check_batch_layout

    layout = check_layout(4, dict(shard=2, cp=2), dict(ep=4, shard=1))
    job = SimpleNamespace(meshes=SimpleNamespace(layout=layout))
    check_batch_layout(load_config("tiny", ["data.batch_size=4", "data.seq_len=32"]), job)
    with pytest.raises(LayoutMismatch, match=r"batch_size=3 .* dp = replicate x shard = 2"):
        check_batch_layout(load_config("tiny", ["data.batch_size=3"]), job)
    with pytest.raises(LayoutMismatch, match=r"seq_len=30 must be divisible by 2 x cp = 4"):
        check_batch_layout(load_config("tiny", ["data.seq_len=30"]), job)
    with pytest.raises(PretrainError, match=r"cp = world size.*launch with torchrun"):
        pretrain(load_config("tiny", ["parallel.cp=2", "train.out_dir=/nonexistent/never"]))
