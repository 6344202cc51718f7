"""Pretraining on the code corpus: the main job until the RL trainer lands.

One step at data position b (one batch per step):

    x, y = batches(b)                                  [B, T] inputs and next tokens
    loss = mean over B*T of  -log softmax(model(x))[y]
    g = clip(grad loss, grad_clip);  optimizer step;  expert-bias update (MoE)

The optimizer is cadenza.optim.build_optimizer: Muon over the model's natural units
(per head, per expert), AdamW over the rest, with its warmup + cosine/WSD schedule
(cfg.optim; optim.optimizer=adamw for AdamW everywhere). Everything that decides the next
step lives in the checkpoint (weights, optimizer moments, RNG, step, data position), and
batches are a pure function of the position, so a resumed run retraces an uninterrupted
one bit for bit.

SIGTERM and SIGINT stop the run after the current step, write a checkpoint and raise
`Interrupted`; a second SIGINT aborts at once.

Under torchrun with `parallel.*` settings the same loop runs on every rank, sharded by
cadenza.parallel (see train/distributed.py); checkpoints are then DCP shards
(train/distributed_checkpoint.py) and the last one also holds the whole model in
Hugging Face format.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cadenza.config import Config, to_dict
from cadenza.config.model import ModelConfig
from cadenza.log.metrics import MetricsWriter, truncate_after
from cadenza.log.progress import Progress
from cadenza.model import CausalLM, generate
from cadenza.model.tokenizer import Tokenizer, read_texts, train_tokenizer
from cadenza.optim import build_optimizer
from cadenza.parallel import LayoutError
from cadenza.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from cadenza.train.corpus import corpus_files
from cadenza.train.data import CorpusData, build_corpus_data
from cadenza.train.distributed import LayoutMismatch, ParallelJob, start
from cadenza.train.distributed_checkpoint import (
    is_distributed_checkpoint,
    load_distributed_checkpoint,
    read_distributed_checkpoint,
    save_distributed_checkpoint,
)

TOKENIZER_DIR = "tokenizer"
METRICS_FILE = "metrics.jsonl"
# Config sections a resumed run must share with its checkpoint (train.* may change, e.g.
# more steps; the model, the tokenizer and the data order may not).
RESUME_SECTIONS = ("model", "tokenizer", "data")


class PretrainError(RuntimeError):
    """The run cannot start or continue as configured; the message says what to do."""


class Interrupted(Exception):
    """A stop signal arrived; the run saved a checkpoint at `step` and stopped."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None) -> None:
        self.signum = signum
        self.step = step
        self.checkpoint = checkpoint
        name = signal.Signals(signum).name
        where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (no step done)"
        super().__init__(f"stopped by {name} after step {step}; {where}")


@dataclass
class PretrainResult:
    step: int
    first_loss: float | None
    train_loss: float | None
    val_loss: float | None
    checkpoint: Path | None
    sample: str | None


# ---- pure pieces ------------------------------------------------------------------------


def lm_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over all B*T positions (fp32 log-softmax)."""
    out = model(inputs)
    logits = getattr(out, "logits", out)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    was_training = model.training
    model.eval()
    try:
        losses = [lm_loss(model, x, y).item() for x, y in batches]
    finally:
        model.train(was_training)
    return sum(losses) / len(losses)


def _config_diff(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _config_diff(a.get(k), b.get(k), f"{path}.{k}" if path else k)
        return out
    return [] if a == b else [f"{path}: checkpoint {a!r}, now {b!r}"]


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# ---- stateful shell ---------------------------------------------------------------------


class StopSignals:
    """Record SIGTERM/SIGINT instead of dying, so the loop can checkpoint and stop."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # second Ctrl-C: abort now
        self.signum = signum

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def move_aside(out: Path) -> Path:
    """Rename run directory `out` to `<out>.<timestamp>[-k]` so a fresh run loses nothing."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = out.with_name(f"{out.name}.{stamp}")
    k = 1
    while aside.exists():
        aside = out.with_name(f"{out.name}.{stamp}-{k}")
        k += 1
    os.rename(out, aside)
    return aside


def obtain_tokenizer(cfg: Config, out_dir: Path, log: Callable[[str], None]) -> Tokenizer:
    """cfg.tokenizer.path if set; else the one cached in out_dir if trained the same way;
    else train one on the corpus and cache it."""
    if cfg.tokenizer.path:
        return Tokenizer.from_file(cfg.tokenizer.path)
    cache = out_dir / TOKENIZER_DIR
    recipe = {
        "corpus": cfg.data.corpus,
        "vocab_size": cfg.tokenizer.vocab_size,
        "max_train_bytes": cfg.tokenizer.max_train_bytes,
    }
    recipe_file = cache / "recipe.json"
    if (cache / "tokenizer.json").is_file() and recipe_file.is_file():
        try:
            if json.loads(recipe_file.read_text()) == recipe:
                log(f"tokenizer: cached {cache / 'tokenizer.json'}")
                return Tokenizer.from_file(cache)
        except ValueError:
            pass
    t0 = time.perf_counter()
    files = corpus_files(cfg.data.corpus, max_bytes=cfg.tokenizer.max_train_bytes)
    tok = train_tokenizer(
        files, vocab_size=cfg.tokenizer.vocab_size, max_bytes=cfg.tokenizer.max_train_bytes
    )
    tok.save(cache)
    recipe_file.write_text(json.dumps(recipe) + "\n")
    log(
        f"tokenizer: trained a {tok.vocab_size}-token byte-level BPE on {len(files)} files "
        f"in {time.perf_counter() - t0:.1f}s -> {cache / 'tokenizer.json'}"
    )
    return tok


def load_corpus(cfg: Config, tokenizer: Tokenizer) -> CorpusData:
    files = corpus_files(cfg.data.corpus, max_files=cfg.data.max_files)
    texts = list(read_texts(files))
    docs = tokenizer.encode_batch(texts, allow_special=False)
    try:
        return build_corpus_data(
            docs,
            tokenizer.bos_id,
            tokenizer.eos_id,
            cfg.data.seq_len,
            cfg.data.batch_size,
            cfg.data.val_fraction,
            cfg.train.seed,
        )
    except ValueError as e:
        raise PretrainError(f"corpus {cfg.data.corpus!r}: {e}") from e


def model_config_for(cfg: ModelConfig, tokenizer: Tokenizer) -> ModelConfig:
    """The model config with the tokenizer's special ids; checks the vocabulary fits."""
    if cfg.vocab_size < tokenizer.vocab_size:
        raise PretrainError(
            f"model.vocab_size={cfg.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer.vocab_size} tokens; set model.vocab_size={tokenizer.vocab_size} "
            f"(or tokenizer.vocab_size={cfg.vocab_size})"
        )
    return replace(
        cfg,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
    )


def generate_sample(
    model: nn.Module, tokenizer: Tokenizer, prompt: str, max_new_tokens: int, seed: int
) -> str:
    ids = tokenizer.encode(prompt, add_bos=True, allow_special=False)
    model.eval()
    (gen,) = generate(
        model,
        [ids],
        max_new_tokens=max_new_tokens,
        temperature=0.8,
        top_p=0.95,
        stop_tokens=[tokenizer.eos_id],
        seed=seed,
    )
    return prompt + tokenizer.decode(gen.tokens, skip_special_tokens=True)


def pretrain(cfg: Config, log: Callable[[str], None] | None = None) -> PretrainResult:
    """Run (or resume, with cfg.train.resume) the pretraining job described by `cfg`.

    Under torchrun (or in a process group the caller set up) every rank calls this."""
    try:
        job = start(cfg)
    except (LayoutError, LayoutMismatch) as e:
        hint = (
            "" if "WORLD_SIZE" in os.environ
            else "; this is one process: for several, launch with torchrun --nproc-per-node N "
            "-m cadenza.cli.main train ..."
        )  # fmt: skip
        raise PretrainError(f"parallel layout: {e}{hint}") from e
    try:
        return _pretrain(cfg, job, log)
    finally:
        if job is not None:
            job.close()


class _Silent:
    """Progress bar and metrics file of ranks other than 0."""

    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def write(self, record: dict[str, Any]) -> None:
        pass

    def update(self, *args: Any) -> None:
        pass

    def print(self, message: str) -> None:
        pass


def _pretrain(
    cfg: Config, job: ParallelJob | None, log: Callable[[str], None] | None
) -> PretrainResult:
    tcfg = cfg.train
    out = Path(tcfg.out_dir)
    main = job is None or job.is_main
    local_ranks = job.local_world_size if job is not None else 1
    torch.set_num_threads(tcfg.threads if tcfg.threads > 0 else max(1, cpu_count() // local_ranks))
    say = log or (lambda msg: print(msg, flush=True))
    if not main:
        say = lambda msg: None  # noqa: E731
    existing = latest_checkpoint(out) if main or tcfg.resume else None

    state: dict[str, Any] | None = None
    if tcfg.resume:
        if existing is None:
            raise PretrainError(
                f"--resume: no checkpoint under {out / 'checkpoints'}; run without --resume "
                "to start, or point train.out_dir at the run to continue"
            )
        if job is None and is_distributed_checkpoint(existing):
            raise PretrainError(
                f"--resume: {existing} was written by a distributed run (DCP shards); resume it "
                "under torchrun (any world size and layout), e.g. torchrun --nproc-per-node 2 "
                "-m cadenza.cli.main train --resume ..."
            )
        if job is not None and not is_distributed_checkpoint(existing):
            raise PretrainError(
                f"--resume: {existing} was written by a single-process run; resume it in one "
                "process (cadenza train --resume, without torchrun)"
            )
        if job is None:
            loaded, tokenizer, state = load_checkpoint(existing)
        else:
            tokenizer, state = read_distributed_checkpoint(existing)
        diff = _config_diff(
            {k: state["config"].get(k) for k in RESUME_SECTIONS},
            {k: to_dict(getattr(cfg, k)) for k in RESUME_SECTIONS},
        )
        if diff:
            raise PretrainError(
                f"--resume: the config differs from checkpoint {existing} in "
                f"{len(diff)} key(s): {'; '.join(diff[:5])}; resume with the same model, "
                "tokenizer and data settings, or start a fresh run in another train.out_dir"
            )
        say(f"resuming from {existing} (step {state['step']})")
    elif main:  # one process prepares the run directory and the tokenizer
        given = Tokenizer.from_file(cfg.tokenizer.path) if cfg.tokenizer.path else None
        if existing is not None or (out / METRICS_FILE).exists():
            aside = move_aside(out)
            say(f"{out} held an earlier run: moved it to {aside} (--resume continues a run)")
            if (aside / TOKENIZER_DIR).is_dir():  # keep the cached tokenizer
                shutil.copytree(aside / TOKENIZER_DIR, out / TOKENIZER_DIR)
        out.mkdir(parents=True, exist_ok=True)
        tokenizer = given or obtain_tokenizer(cfg, out, say)
    if job is not None and not tcfg.resume:
        job.barrier()  # rank 0's tokenizer is on disk: the others load it
        if not main:
            tokenizer = Tokenizer.from_file(cfg.tokenizer.path or out / TOKENIZER_DIR)

    model_cfg = model_config_for(cfg.model, tokenizer)
    data = load_corpus(cfg, tokenizer)
    say(
        f"data: {data.n_docs} files, {len(data.train.stream):,} train / "
        f"{len(data.val.stream):,} val tokens; {data.train.n_windows:,} windows of "
        f"{cfg.data.seq_len}; {tcfg.steps} steps x {data.train.tokens_per_batch:,} tokens "
        f"= {tcfg.steps * data.train.batch_size / data.train.n_windows:.2f} epochs"
    )

    torch.manual_seed(tcfg.seed)
    random.seed(tcfg.seed)
    model = CausalLM(model_cfg)  # the same full model on every rank, then sharded
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    if job is not None:
        model = job.parallelize(model, cfg)
    optimizer = build_optimizer(model, cfg)
    step, position = 0, 0
    if state is not None:
        if state["data_fingerprint"] != data.fingerprint:
            raise PretrainError(
                f"--resume: the corpus tokenizes differently than when {existing} was "
                "written (files changed?); resume on the same corpus or start a fresh run"
            )
        if job is None:
            model.load_state_dict(loaded.state_dict())
            try:
                optimizer.load_state_dict(state["optimizer"])
            except (ValueError, KeyError) as e:
                raise PretrainError(f"--resume from {existing}: optimizer state: {e}") from e
            del loaded
        else:
            load_distributed_checkpoint(existing, model, optimizer, state)
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        step, position = state["step"], state["data_position"]
        if main:
            truncate_after(out / METRICS_FILE, step)

    ranks = f"; {job.world_size} ranks" if job is not None else ""
    say(f"model: {n_params / 1e6:.2f}M parameters; threads {torch.get_num_threads()}{ranks}")
    eval_set = data.val.eval_batches(tcfg.eval_batches)

    def trainer_state(loss: float | None, val: float | None) -> dict[str, Any]:
        if job is not None:  # the moments go to DCP, sharded
            opt = {
                "optimizer_counters": {
                    "steps": optimizer.steps,
                    "skipped_steps": optimizer.skipped_steps,
                }
            }
        else:
            opt = {"optimizer": optimizer.state_dict()}
        return {
            "data_position": position,
            **opt,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            "model_config": to_dict(model_cfg),
            "config": to_dict(cfg),
            "data_fingerprint": data.fingerprint,
            "train_loss": loss,
            "val_loss": val,
        }

    whole: list[nn.Module | None] = []  # the gathered model of a distributed run's last step

    def full_model() -> nn.Module | None:
        if not whole:
            whole.append(job.full_model(model, model_cfg))
        return whole[0]

    def save(loss: float | None, val: float | None) -> Path:
        if job is None:
            return save_checkpoint(
                out, step, model, tokenizer, trainer_state(loss, val), keep=tcfg.keep_checkpoints
            )
        return save_distributed_checkpoint(
            job, out, step, model, optimizer, tokenizer, trainer_state(loss, val),
            keep=tcfg.keep_checkpoints,
            hf_model=full_model() if step == tcfg.steps else None,
        )  # fmt: skip

    def evaluate_all() -> float:
        return evaluate(model, eval_set) if job is None else job.evaluate(model, eval_set)

    def stop_signal(stop: StopSignals) -> int | None:
        return stop.signum if job is None else job.stop_signal(stop.signum)

    ckpt: Path | None = existing if state is not None else None
    first_loss = loss_value = val_loss = None
    saved_step = step if state is not None else -1
    with (
        MetricsWriter(out / METRICS_FILE) if main else _Silent() as metrics,
        StopSignals() as stop,
        Progress(tcfg.steps, start=step, every=tcfg.log_every) if main else _Silent() as bar,
    ):
        tps_avg = 0.0
        while step < tcfg.steps and stop_signal(stop) is None:
            t0 = time.perf_counter()
            lrs = optimizer.lrs
            inputs, targets = data.train.batch(position)
            if job is None:
                loss = lm_loss(model, inputs, targets)
                loss_value = loss.item()
            else:  # this rank's share; the sum over ranks is the global mean
                loss = job.loss(model, inputs, targets)
                loss_value = job.total(loss)
            if not math.isfinite(loss_value):
                raise PretrainError(
                    f"loss is {loss_value} at step {step + 1}; lower optim.lr (now {cfg.optim.lr}) "
                    "or resume from an earlier checkpoint"
                )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            clip = tcfg.grad_clip if tcfg.grad_clip > 0 else float("inf")
            if job is None:
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item()
            else:
                grad_norm = job.clip_grad_norm_(model.parameters(), clip)
                job.sync_model_stats(model)  # global expert loads and max logits
            if not optimizer.step():  # optim.nonfinite=skip: a counted skip
                bar.print(f"step {step + 1}: non-finite gradient, update skipped")
            model.update_router_biases()  # aux-loss-free balancing from this step's loads
            step += 1
            position += 1
            first_loss = loss_value if first_loss is None else first_loss
            dt = time.perf_counter() - t0
            tps = data.train.tokens_per_batch / dt
            tps_avg = tps if tps_avg == 0 else 0.9 * tps_avg + 0.1 * tps
            record = {
                "step": step,
                "loss": loss_value,
                **{f"lr_{k}": v for k, v in lrs.items()},
                "grad_norm": grad_norm,
                "tokens": position * data.train.tokens_per_batch,
                "tokens_per_s": tps,
                "step_time": dt,
                "epoch": data.train.epoch_of(position),
            }
            if step % tcfg.eval_every == 0 or step == tcfg.steps:
                val_loss = evaluate_all()
                record["val_loss"] = val_loss
                bar.print(f"step {step}: train loss {loss_value:.4f}, val loss {val_loss:.4f}")
            metrics.write(record)
            bar.update(step, loss_value, tps_avg)
            if step % tcfg.ckpt_every == 0 or step == tcfg.steps:
                ckpt = save(loss_value, val_loss)
                saved_step = step
        signum = stop_signal(stop)
        if signum is not None:
            if step > 0 and saved_step != step:
                ckpt = save(loss_value, val_loss)
            raise Interrupted(signum, step, ckpt if step > 0 else None)

    if val_loss is None:
        val_loss = evaluate_all()
    sample = None
    if tcfg.sample_tokens > 0 and tcfg.sample_prompt:
        # A distributed run samples on rank 0 from the gathered model (the KV-cache decoder
        # is single-process code).
        sampler = model if job is None else full_model()
        if sampler is not None:
            sample = generate_sample(
                sampler, tokenizer, tcfg.sample_prompt, tcfg.sample_tokens, tcfg.seed
            )
            (out / "sample.txt").write_text(sample + "\n", encoding="utf-8")
            say(f"sample (temperature 0.8, top-p 0.95):\n{sample}")
    say(f"done: step {step}, val loss {val_loss:.4f}, checkpoint {ckpt}")
    return PretrainResult(step, first_loss, loss_value, val_loss, ckpt, sample)
