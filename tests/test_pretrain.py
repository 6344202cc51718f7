"""The pretraining job end to end on a tinier-than-tiny model.

Oracles: transformers loads the checkpoint and computes the same logits; an uninterrupted
run in this process is the reference for runs killed (SIGTERM, SIGKILL) and resumed in
other processes: same per-step losses, same final weights, bit for bit.
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cadenza.config import load_config
from cadenza.log.metrics import read_jsonl
from cadenza.model.tokenizer import train_tokenizer
from cadenza.train.checkpoint import CheckpointError, latest_checkpoint, list_checkpoints
from cadenza.train.corpus import corpus_files
from cadenza.train.pretrain import PretrainError, pretrain

pytestmark = pytest.mark.slow

STEPS = 30
# A model and data small enough for seconds per run (shared with the distributed tests).
TINY_MODEL_AND_DATA = [
    "model.vocab_size=512",
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.moe_intermediate_size=16",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=2",
    "model.q_lora_rank=16",
    "model.kv_lora_rank=16",
    "model.qk_nope_head_dim=8",
    "model.qk_rope_head_dim=8",
    "model.v_head_dim=8",
    "model.n_routed_experts=4",
    "model.num_experts_per_tok=2",
    "data.max_files=30",
    "data.seq_len=32",
    "data.batch_size=4",
    "data.val_fraction=0.1",
]
TINIER = [
    *TINY_MODEL_AND_DATA,
    f"train.steps={STEPS}",
    "optim.warmup_steps=5",
    "optim.lr=0.01",
    "optim.adamw_lr=0.01",
    "train.log_every=5",
    "train.eval_every=10",
    "train.ckpt_every=10",
    "train.keep_checkpoints=0",
    "train.threads=1",
    "train.sample_tokens=8",
]


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    files = corpus_files("stdlib", max_bytes=600_000)
    return str(train_tokenizer(files, vocab_size=512, max_bytes=600_000).save(d))


def _overrides(tokenizer_path, out_dir, *extra):
    return [*TINIER, f"tokenizer.path={tokenizer_path}", f"train.out_dir={out_dir}", *extra]


def _cfg(tokenizer_path, out_dir, *extra):
    return load_config("tiny", _overrides(tokenizer_path, out_dir, *extra))


@pytest.fixture(scope="module")
def reference(tokenizer_path, tmp_path_factory):
    """An uninterrupted run, in this process."""
    out = tmp_path_factory.mktemp("ref")
    result = pretrain(_cfg(tokenizer_path, out), log=lambda m: None)
    return out, result


def _losses(out_dir):
    return [(r["step"], r["loss"]) for r in read_jsonl(Path(out_dir) / "metrics.jsonl")]


def _final_weights(out_dir):
    ckpt = latest_checkpoint(out_dir)
    assert ckpt is not None and ckpt.name == f"step_{STEPS:08d}"
    return load_file(str(ckpt / "model.safetensors"))


def _assert_same_run(out_dir, ref_dir):
    assert _losses(out_dir) == _losses(ref_dir)
    a, b = _final_weights(out_dir), _final_weights(ref_dir)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def _spawn(tokenizer_path, out_dir, *extra):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "cadenza.cli.main", "train",
         *_overrides(tokenizer_path, out_dir), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


def _wait_for(predicate, proc, timeout=120.0):
    t0 = time.monotonic()
    while not predicate():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"run ended before the kill point (rc={proc.returncode}):\n{out}\n{err}")
        if time.monotonic() - t0 > timeout:
            proc.kill()
            pytest.fail("timed out waiting for the kill point")
        time.sleep(0.005)


def test_short_run_loss_falls_and_transformers_loads_the_checkpoint(reference):
    out, result = reference
    losses = [loss for _, loss in _losses(out)]
    assert len(losses) == STEPS
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5, losses
    assert result.val_loss is not None and result.val_loss < losses[0]
    assert result.sample.startswith("def fibonacci(n):")
    assert (out / "sample.txt").read_text().startswith("def fibonacci(n):")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cadenza.model import from_pretrained

    ckpt = result.checkpoint
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    ours = from_pretrained(ckpt).eval()
    ids = torch.tensor([AutoTokenizer.from_pretrained(str(ckpt)).encode("import os\nx = 1")])
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)
    torch.testing.assert_close(getattr(got, "logits", got), expected, atol=1e-4, rtol=1e-4)


def test_sigterm_then_resume_matches_uninterrupted(tokenizer_path, reference, tmp_path):
    proc = _spawn(tokenizer_path, tmp_path)
    metrics = tmp_path / "metrics.jsonl"
    _wait_for(lambda: len(read_jsonl(metrics)) >= 13, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM" in err and "--resume" in err
    stopped = list_checkpoints(tmp_path)[-1][0]
    assert 13 <= stopped < STEPS  # a checkpoint at the step where it stopped, not only at 10

    r = subprocess.run(
        [sys.executable, "-m", "cadenza.cli.main", "train", "--resume",
         *_overrides(tokenizer_path, tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert f"resuming from {tmp_path / 'checkpoints' / f'step_{stopped:08d}'}" in r.stdout
    _assert_same_run(tmp_path, reference[0])


def test_sigkill_after_checkpoint_then_resume_matches_uninterrupted(
    tokenizer_path, reference, tmp_path
):
    proc = _spawn(tokenizer_path, tmp_path)
    _wait_for(lambda: (tmp_path / "checkpoints" / "step_00000010").is_dir(), proc)
    proc.kill()
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    # A checkpoint torn by a kill mid-write is a hidden temporary directory: ignored.
    torn = tmp_path / "checkpoints" / ".tmp-step_00000020-12345"
    torn.mkdir()
    (torn / "config.json").write_text("{")
    result = pretrain(_cfg(tokenizer_path, tmp_path, "train.resume=true"), log=lambda m: None)
    assert result.step == STEPS and not torn.exists()
    _assert_same_run(tmp_path, reference[0])


def test_resume_problems_give_clear_errors(tokenizer_path, reference, tmp_path):
    ref_out, result = reference
    with pytest.raises(PretrainError, match="no checkpoint under .*run without --resume"):
        pretrain(_cfg(tokenizer_path, tmp_path / "empty", "train.resume=true"))
    # A fresh run where a run exists moves the old one aside (nothing lost).
    again = tmp_path / "again"
    shutil.copytree(ref_out, again)
    messages = []
    pretrain(_cfg(tokenizer_path, again, "train.steps=2"), log=messages.append)
    (moved,) = tmp_path.glob("again.*")
    assert any(f"moved it to {moved}" in m for m in messages)
    assert _losses(moved) == _losses(ref_out) and len(_losses(again)) == 2
    with pytest.raises(PretrainError, match=r"config differs .*model.hidden_size"):
        pretrain(_cfg(tokenizer_path, ref_out, "train.resume=true", "model.hidden_size=48"))
    with pytest.raises(PretrainError, match=r"optimizer state: .*optim.optimizer"):
        pretrain(_cfg(tokenizer_path, ref_out, "train.resume=true", "optim.optimizer=adamw"))

    def broken(name, damage):
        out = tmp_path / name
        shutil.copytree(result.checkpoint, out / "checkpoints" / result.checkpoint.name)
        damage(out / "checkpoints" / result.checkpoint.name)
        return _cfg(tokenizer_path, out, "train.resume=true")

    cfg = broken("nomodel", lambda d: (d / "model.safetensors").unlink())
    with pytest.raises(CheckpointError, match=r"incomplete: missing \*\.safetensors.*delete"):
        pretrain(cfg)
    cfg = broken("badstate", lambda d: (d / "trainer_state.pt").write_bytes(b"garbage"))
    with pytest.raises(CheckpointError, match="trainer_state.pt cannot be read"):
        pretrain(cfg)

    def truncate(d):
        p = d / "model.safetensors"
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])

    with pytest.raises(CheckpointError, match="the model cannot be loaded"):
        pretrain(broken("truncated", truncate))
    r = subprocess.run(
        [sys.executable, "-m", "cadenza.cli.main", "train", "--resume",
         *_overrides(tokenizer_path, tmp_path / "truncated")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and r.stderr.startswith("error: checkpoint ")
    assert "Traceback" not in r.stderr
