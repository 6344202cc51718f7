"""The RL loop: rollouts -> grading -> feedback -> loss -> optimizer step, resumable.

One step:
    tasks = env.sample_tasks(tasks_per_step)
    groups = env.rollout(policy, tasks, G)           # graded episodes, behavior logprobs
    hints = feedback.annotate(episode) per episode    # (turn, hint) pairs -> hint tokens
    loss = L_RL / N_RL + lambda * L_KL / N_hint       # rl/objective.py
    backward, clip, optimizer step, teacher EMA update

Determinism: sampling at step s uses a generator seeded from (seed, s) and the task stream is
a seeded `random.Random` whose state is checkpointed, so a run resumed from the checkpoint of
step s continues exactly as the uninterrupted run (same metrics, same weights).

Checkpoints (model, optimizer, teacher/reference copies, RNG states, step) are written every
`train.ckpt_every` steps and at the end to `out_dir/rl_checkpoint.pt`, atomically (temp file,
then rename). SIGTERM/SIGINT finish the step in flight, checkpoint, and raise
`cadenza.train.pretrain.Interrupted` (the CLI exits 128 + signal). Metrics are one JSON line
per step in `out_dir/metrics.jsonl` (cadenza.log.metrics); on resume, lines past the
checkpoint are dropped so the file reads as one uninterrupted run.

The checkpoint also holds the environment's own position (`env.state_dict()`, e.g. the
agent env's round-robin index into the task store) when it has one.

The checkpoint is a single torch file rather than cadenza.train.checkpoint's Hugging Face
directory because the toy policy is not a CausalLM (that format needs save_pretrained and a
tokenizer); with the agent environment the policy is a CausalLM and the same file is used.
"""

from __future__ import annotations

import copy
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cadenza.config.job import Config
from cadenza.log.metrics import MetricsWriter, truncate_after
from cadenza.log.progress import Progress
from cadenza.rl.feedback import FeedbackContext, annotate, build_providers
from cadenza.rl.feedback_loss import empty_hint_self_test
from cadenza.rl.objective import episode_metrics, rl_objective
from cadenza.rl.rollout import Environment
from cadenza.rl.teacher import Teacher
from cadenza.train.pretrain import Interrupted, PretrainError, StopSignals

CKPT_NAME = "rl_checkpoint.pt"


def _agent_format(cfg: Config):
    """The agent env's chat format and the policy's model config (rl.init_from or model.*)."""
    from cadenza.agent.chat_format import CadenzaFormat, load_chat_format
    from cadenza.model import load_config

    if cfg.rl.init_from:
        path = Path(cfg.rl.init_from)
        if not (path / "tokenizer.json").is_file():
            raise ValueError(
                f"rl.init_from={cfg.rl.init_from!r}: expected a checkpoint directory with "
                "config.json, *.safetensors and tokenizer.json (a `cadenza train` checkpoint, "
                "e.g. runs/tiny/checkpoints/step_00000300)"
            )
        return load_chat_format(path), load_config(path)
    if not cfg.tokenizer.path:
        raise ValueError(
            "rl.env=agent needs a policy with a tokenizer: set rl.init_from=CHECKPOINT_DIR, or "
            "tokenizer.path=tokenizer.json for a fresh model.* policy"
        )
    return CadenzaFormat(cfg.tokenizer.path), cfg.model


def build_env(cfg: Config) -> Environment:
    if cfg.rl.env == "toy":
        from cadenza.rl.toy_env import ToyEnv

        return ToyEnv(temperature=cfg.rl.temperature, max_context=cfg.rl.max_context)
    if cfg.rl.env == "agent":
        from dataclasses import replace

        from cadenza.rl.agent_env import AgentEnv

        fmt, model_cfg = _agent_format(cfg)
        # an episode never outgrows the positions the policy was built for
        limit = min(cfg.agent.max_context, model_cfg.max_position_embeddings)
        return AgentEnv(
            cfg.rl.tasks_dir,
            fmt,
            replace(cfg.agent, max_context=limit),
            temperature=cfg.rl.temperature,
            order=cfg.rl.task_order,
            reward=cfg.rl.reward,
            tools=cfg.rl.tools,
        )
    raise ValueError(f"rl.env: expected 'toy' or 'agent', found {cfg.rl.env!r}")


def build_policy(cfg: Config, env: Environment) -> nn.Module:
    """A fresh policy for the environment, warmed up (deterministic for train.seed)."""
    if cfg.rl.env == "toy":
        from cadenza.rl.toy_env import ToyPolicy, micro_causal_lm, warmup

        torch.manual_seed(cfg.train.seed)
        model = ToyPolicy() if cfg.rl.policy == "gru" else micro_causal_lm()
        if cfg.rl.warmup_steps > 0:
            # the transformer's warm-up overshoots at the GRU's Adam lr (measured: loss 0.40
            # vs 0.32 at 3e-3 after 300 steps)
            lr = 1e-2 if cfg.rl.policy == "gru" else 3e-3
            warmup(model, steps=cfg.rl.warmup_steps, seed=cfg.train.seed, lr=lr)
        return model
    if cfg.rl.env == "agent":
        from cadenza.model import CausalLM, from_pretrained

        torch.manual_seed(cfg.train.seed)
        model = from_pretrained(cfg.rl.init_from) if cfg.rl.init_from else CausalLM(cfg.model)
        vocab = env.fmt.vocab_size
        if model.cfg.vocab_size < vocab:
            raise ValueError(
                f"the policy's vocab_size {model.cfg.vocab_size} is smaller than its tokenizer's "
                f"{vocab}; set model.vocab_size={vocab} (or use a matching rl.init_from)"
            )
        return model
    raise ValueError(f"rl.env: no policy builder for {cfg.rl.env!r}")


def build_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    if cfg.rl.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=cfg.rl.lr, weight_decay=0.0)
    if cfg.rl.optimizer == "muon":
        from cadenza.optim import build_optimizer as build_muon

        return build_muon(model, cfg)
    raise ValueError(f"rl.optimizer: expected 'adamw' or 'muon', found {cfg.rl.optimizer!r}")


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class RLTrainer:
    def __init__(self, cfg: Config, model: nn.Module, env: Environment, optimizer=None):
        self.cfg = cfg
        self.rl = cfg.rl
        self.model = model
        self.env = env
        self.optimizer = optimizer or build_optimizer(model, cfg)
        fb = self.rl.feedback
        self.teacher = Teacher(model, fb.teacher, fb.ema_decay) if fb.enabled else None
        options = {"llm_judge": {"base_url": fb.judge_url, "model": fb.judge_model}}
        self.providers = build_providers(fb.providers, **options) if fb.enabled else []
        self.ref = copy.deepcopy(model).requires_grad_(False) if self.rl.ref_kl_coef > 0 else None
        self.step = 0
        self.rng = random.Random(cfg.train.seed)
        self.out_dir = Path(cfg.train.out_dir)

    # -- one step -------------------------------------------------------------------------
    def _hints(self, groups, tasks) -> tuple[dict, dict]:
        hints, dropped = {}, {}
        errors: dict[str, int] = {}
        for gi, (g, task) in enumerate(zip(groups, tasks)):
            for ei, ep in enumerate(g):
                ctx: FeedbackContext = self.env.feedback_context(task)
                ctx.max_message_chars = self.rl.feedback.max_message_chars
                found, drop = annotate(ep, self.providers, ctx)
                for k, v in drop.items():
                    dropped[k] = dropped.get(k, 0) + v
                for k, v in ctx.errors.items():
                    errors[k] = errors.get(k, 0) + v
                if found:
                    hints[(gi, ei)] = [
                        (h, self.env.render_hint(h.text, ep, h.turn_index)) for h in found
                    ]
        return hints, {"hints_dropped": dropped, "provider_errors": errors}

    def train_step(self) -> dict:
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(self.cfg.train.seed * 1_000_003 + self.step)
        tasks = self.env.sample_tasks(self.rl.tasks_per_step, self.rng)
        groups = self.env.rollout(self.model, tasks, self.rl.group_size, gen)
        metrics: dict = {}
        metrics.update(episode_metrics([e for g in groups for e in g]))
        hints, info = self._hints(groups, tasks) if self.teacher is not None else ({}, {})
        if self.step == 0 and self.teacher is not None:
            # the empty-hint self-test on a real episode: must be exactly zero (see rl/kl.py)
            info["self_test"] = empty_hint_self_test(
                self.model, groups[0][0], self.rl.feedback.estimator
            )
        out = rl_objective(
            self.model,
            groups,
            self.rl,
            hints,
            self.teacher.model if self.teacher is not None else None,
            self.ref,
        )
        self.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.rl.grad_clip)
        self.optimizer.step()
        if self.teacher is not None:
            self.teacher.update()
        self.step += 1
        metrics["step"] = self.step  # steps done, as in the pretraining metrics
        metrics.update(out.metrics, **info, grad_norm=float(grad_norm))
        metrics["step_time_s"] = time.perf_counter() - t0
        return metrics

    # -- checkpoints ----------------------------------------------------------------------
    @property
    def ckpt_path(self) -> Path:
        return self.out_dir / CKPT_NAME

    def save_checkpoint(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        state = {
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "teacher": self.teacher.state_dict() if self.teacher is not None else {},
            "ref": self.ref.state_dict() if self.ref is not None else {},
            "task_rng": self.rng.getstate(),
            "env": self.env.state_dict() if hasattr(self.env, "state_dict") else {},
            "torch_rng": torch.get_rng_state(),
        }
        _atomic_save(state, self.ckpt_path)

    def load_checkpoint(self) -> bool:
        if not self.ckpt_path.is_file():
            return False
        state = torch.load(self.ckpt_path, weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.teacher is not None:
            self.teacher.load_state_dict(state["teacher"])
        if self.ref is not None and state["ref"]:
            self.ref.load_state_dict(state["ref"])
        self.rng.setstate(state["task_rng"])
        if hasattr(self.env, "load_state_dict"):
            self.env.load_state_dict(state.get("env", {}))
        torch.set_rng_state(state["torch_rng"])
        self.step = state["step"]
        return True

    # -- the loop -------------------------------------------------------------------------
    def run(self, steps: int, on_step: Callable[[dict], None] | None = None) -> list[dict]:
        """Train until `steps` total steps; returns this call's metrics.

        SIGTERM/SIGINT: the step in flight finishes, a checkpoint is written, and
        `cadenza.train.pretrain.Interrupted` is raised (the CLI turns it into exit 128+sig)."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        metrics_path = self.out_dir / "metrics.jsonl"
        truncate_after(metrics_path, self.step)  # records past the checkpoint: redone below
        history = []
        with StopSignals() as stop, MetricsWriter(metrics_path) as writer:
            while self.step < steps and stop.signum is None:
                m = self.train_step()
                writer.write(m)
                history.append(m)
                if on_step is not None:
                    on_step(m)
                every = self.cfg.train.ckpt_every
                if every > 0 and self.step % every == 0:
                    self.save_checkpoint()
            self.save_checkpoint()
            if stop.signum is not None and self.step < steps:
                raise Interrupted(stop.signum, self.step, self.ckpt_path)
        return history


def _progress_line(m: dict) -> str:
    return (
        f"rl step {m['step']:>5} reward {m['reward']:.3f} "
        f"invalid-calls {m['invalid_call_rate']:.3f} hints {m['hint_spans']:>3} "
        f"kl {m['hint_kl_mean']:.4f} loss {m.get('loss', 0.0):+.4f}"
    )


def run_rl_job(
    cfg: Config, quiet: bool = False, on_step: Callable[[dict], None] | None = None
) -> RLTrainer:
    """`cadenza train train.mode=rl`: build env, policy and trainer; resume if asked."""
    torch.manual_seed(cfg.train.seed)
    if cfg.train.threads > 0:
        torch.set_num_threads(cfg.train.threads)
    from dataclasses import replace

    from cadenza.tasks.errors import TaskError

    resuming = cfg.train.resume and (Path(cfg.train.out_dir) / CKPT_NAME).is_file()
    try:
        env = build_env(cfg)
        # on resume the weights come from the checkpoint: skip the warm-up
        model = build_policy(
            replace(cfg, rl=replace(cfg.rl, warmup_steps=0)) if resuming else cfg, env
        )
    except (ValueError, TaskError) as e:  # a bad store, tokenizer or checkpoint: say so, no trace
        raise PretrainError(f"rl.env={cfg.rl.env}: {e}") from e
    trainer = RLTrainer(cfg, model, env)
    if resuming:
        trainer.load_checkpoint()
    if quiet:
        trainer.run(cfg.train.steps, on_step=on_step)
    else:
        every = max(cfg.train.log_every, 1)
        with Progress(cfg.train.steps, trainer.step, every, description="rl") as progress:

            def each(m: dict) -> None:
                rate = m["episode_tokens"] / m["step_time_s"]
                progress.update(m["step"], m.get("loss", 0.0), rate)
                if m["step"] % every == 0:
                    progress.print(_progress_line(m))
                if on_step is not None:
                    on_step(m)

            trainer.run(cfg.train.steps, on_step=each)
    if cfg.rl.env == "agent":
        export_policy(cfg, trainer.model)
    return trainer


def _tokenizer_files(cfg: Config) -> list[tuple[Path, str]]:
    """(source, name in the export) of the policy's tokenizer files."""
    if cfg.rl.init_from:
        src = Path(cfg.rl.init_from)
        names = ("tokenizer.json", "tokenizer_config.json")  # the latter: chat_template
        return [(src / n, n) for n in names if (src / n).is_file()]
    p = Path(cfg.tokenizer.path)
    return [(p / "tokenizer.json" if p.is_dir() else p, "tokenizer.json")]


def export_policy(cfg: Config, model: nn.Module) -> Path:
    """`out_dir/policy`: the trained CausalLM as a Hugging Face directory with its tokenizer
    (and chat template), what `cadenza serve` / `cadenza eval` / `rl.init_from` load.

    Written to a temporary directory and renamed, so a reader sees the old or the new one."""
    import shutil

    from cadenza.model import save_pretrained

    out = Path(cfg.train.out_dir)
    dst, tmp, old = out / "policy", out / ".policy.tmp", out / ".policy.old"
    for p in (tmp, old):
        shutil.rmtree(p, ignore_errors=True)
    try:
        save_pretrained(model, tmp)
        for src, name in _tokenizer_files(cfg):
            shutil.copyfile(src, tmp / name)
        if dst.exists():
            os.rename(dst, old)
        os.rename(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return dst
