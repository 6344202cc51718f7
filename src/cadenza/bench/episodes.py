"""Episodes per hour for the tiny policy on this machine's CPUs.

Figure: G episodes of one task run as a group (one batched `generate` per turn).
Baseline, same run: the same G episodes run one at a time (a group of 1 each).
Each episode is a full one: workspace export (git repo), up to --turns assistant turns of
--new-tokens sampled tokens, tool calls or feedback, the patch, and grading (hidden test).
The model is random-initialized unless --ckpt gives a checkpoint, so replies are mostly
malformed and every turn exercises the harness's feedback path.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_CALC = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    raise NotImplementedError\n"
_VISIBLE = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
_HIDDEN = "from calc import mul\n\n\ndef test_mul():\n    assert mul(3, 4) == 12\n"
_SPECIALS = [
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|tool_call|>",
    "<|/tool_call|>",
    "<|tool_result|>",
    "<|/tool_result|>",
]


def _git(ws: Path, *args: str) -> None:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "b",
        "GIT_AUTHOR_EMAIL": "b@b",
        "GIT_COMMITTER_NAME": "b",
        "GIT_COMMITTER_EMAIL": "b@b",
    }
    subprocess.run(["git", "-C", str(ws), *args], check=True, capture_output=True, env=env)


def _workspace(ws: Path) -> None:
    (ws / "tests").mkdir(parents=True)
    (ws / "calc.py").write_text(_CALC)
    (ws / "tests" / "test_add.py").write_text(_VISIBLE)
    _git(ws, "init", "-q")
    _git(ws, "add", "-A")
    _git(ws, "commit", "-qm", "task")


def _grade(patch: str, scratch: Path) -> bool:
    ws = Path(tempfile.mkdtemp(dir=scratch))
    _workspace(ws / "w")
    ws = ws / "w"
    if patch.strip():
        (ws / "p.patch").write_text(patch)
        if subprocess.run(
            ["git", "-C", str(ws), "apply", "p.patch"], capture_output=True
        ).returncode:
            return False
    (ws / "tests" / "test_hidden.py").write_text(_HIDDEN)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_hidden.py"],
        cwd=ws,
        capture_output=True,
    )
    return r.returncode == 0


def _command_runner():
    """The real sandbox runs the tools (None: the harness's default, cadenza.sandbox.run)."""
    from cadenza.sandbox import isolation

    iso = isolation()
    return None, "cadenza.sandbox (" + (
        "bubblewrap" if iso.bwrap else "UNSAFE: no bubblewrap"
    ) + ")"


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers.pre_tokenizers import ByteLevel

    from cadenza.agent.tools import Toolbox
    from cadenza.config.agent import DEFAULT_SYSTEM_PROMPT

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    import json

    corpus = [DEFAULT_SYSTEM_PROMPT, _CALC, _VISIBLE] + [
        json.dumps(s["function"]) for s in Toolbox().schemas()
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=1200,
        special_tokens=_SPECIALS,
        initial_alphabet=ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus * 4, trainer)
    return tok


def run(argv: list[str]) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="cadenza bench episodes", description=__doc__)
    p.add_argument("--group", type=int, default=2, help="episodes per group (G)")
    p.add_argument("--turns", type=int, default=2, help="assistant turns per episode")
    p.add_argument("--new-tokens", type=int, default=16, help="sampled tokens per turn")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each (median)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument(
        "--ckpt", default=None, help="a checkpoint directory instead of a random tiny model"
    )
    a = p.parse_args(argv)

    import torch

    from cadenza.agent.chat_format import CadenzaFormat, load_chat_format
    from cadenza.agent.policies import LocalPolicy
    from cadenza.agent.runner import AgentTask, EpisodeRunner
    from cadenza.config.agent import AgentConfig
    from cadenza.config.model import tiny_model
    from cadenza.model import CausalLM, from_pretrained

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    if a.ckpt:
        model, fmt = from_pretrained(a.ckpt), load_chat_format(a.ckpt)
    else:
        tok = _tokenizer()
        cfg = tiny_model()
        cfg.vocab_size = tok.get_vocab_size()
        model, fmt = CausalLM(cfg), CadenzaFormat(tok)
    model.eval()
    run_command, runner_note = _command_runner()
    unsafe = "UNSAFE" in runner_note
    agent_cfg = AgentConfig(max_turns=a.turns, max_new_tokens=a.new_tokens, unsafe_sandbox=unsafe)
    scratch = Path(tempfile.mkdtemp(prefix="cadenza-bench-episodes-"))
    task = AgentTask(
        "calc-mul",
        "Implement mul(a, b) in calc.py.",
        _workspace,
        grade=lambda patch: _grade(patch, scratch),
        test_command=(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"),
        ro_binds=(sys.prefix,),
    )
    counter = iter(range(1 << 30))

    def episodes(batched: bool) -> float:
        policy = LocalPolicy(model, fmt, temperature=1.0, seed=next(counter))
        runner = EpisodeRunner(policy, fmt, agent_cfg, run_command=run_command)
        t0 = time.perf_counter()
        if batched:
            eps = runner.run_group(task, a.group, scratch / f"g{next(counter)}")
        else:
            eps = [
                e
                for _ in range(a.group)
                for e in runner.run_group(task, 1, scratch / f"s{next(counter)}")
            ]
        dt = time.perf_counter() - t0
        stats.append(
            (
                sum(len(e.assistant_turns()) for e in eps),
                sum(sum(e.policy_mask) for e in eps),
                len(eps),
            )
        )
        return dt

    stats: list[tuple[int, int, int]] = []

    episodes(True)  # warm-up
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(a.repeats):  # interleaved, so load changes hit both alike
        for mode in (True, False):
            times[mode].append(episodes(mode))
    batched, single = statistics.median(times[True]), statistics.median(times[False])
    turns = sum(t for t, _, _ in stats) / sum(n for _, _, n in stats)
    sampled = sum(k for _, k, _ in stats) / sum(n for _, _, n in stats)
    eph_batched = a.group * 3600 / batched
    eph_single = a.group * 3600 / single
    result = {
        "episodes_per_hour": eph_batched,
        "baseline_episodes_per_hour_unbatched": eph_single,
        "ratio": eph_batched / eph_single,
        "group": a.group,
        "turns": a.turns,
        "new_tokens": a.new_tokens,
        "threads": a.threads,
        "commands": runner_note,
        "mean_assistant_turns": turns,
        "mean_sampled_tokens": sampled,
    }
    print(
        f"episodes/hour, tiny policy, G={a.group}, {a.turns} turns x {a.new_tokens} tokens, "
        f"{a.threads} threads, commands via {runner_note}\n"
        f"(per episode: {turns:.1f} assistant turns, {sampled:.0f} sampled tokens, graded):\n"
        f"  batched group : {eph_batched:8.0f}  ({batched:.2f} s per group, median of {a.repeats})\n"
        f"  one at a time : {eph_single:8.0f}  ({single:.2f} s, baseline)\n"
        f"  ratio         : {eph_batched / eph_single:.2f}x"
    )
    return result
