"""Test helpers for the agent harness: a subprocess stand-in for the sandbox, a byte-level
tokenizer with the chat special tokens, and a tiny task (a git repo with visible and hidden
tests) with its own grader, built independently of the code under test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class ProcResult:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool = False
    duration_s: float = 0.0
    truncated: bool = False
    killed_by: str | None = None


def local_run(
    argv, workspace, *, timeout, memory_mb=None, env=None, ro_binds=(), cwd=None, unsafe=False
):
    """Plain subprocess with the signature of cadenza.sandbox.run (no isolation: tests only)."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run(
            argv,
            cwd=cwd or workspace,
            capture_output=True,
            timeout=timeout,
            env={**os.environ, **(env or {})},
        )
    except subprocess.TimeoutExpired as e:
        return ProcResult(-9, (e.stdout or b"").decode(errors="replace"), "", True, timeout)
    return ProcResult(
        p.returncode,
        p.stdout.decode(errors="replace"),
        p.stderr.decode(errors="replace"),
        False,
        time.perf_counter() - t0,
    )


CHAT_SPECIALS = [  # the special tokens of cadenza's tokenizer, in its order
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


def byte_tokenizer():
    """A byte-level BPE with no merges (every byte one token) plus the chat special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(CHAT_SPECIALS)
    return tok


CALC = """def add(a, b):
    return a + b


def mul(a, b):
    raise NotImplementedError
"""

VISIBLE_TEST = """from calc import add


def test_add():
    assert add(2, 3) == 5
"""

HIDDEN_TEST = """from calc import mul


def test_mul():
    assert mul(3, 4) == 12
    assert mul(0, 7) == 0
"""

FIXED_MUL = "def mul(a, b):\n    return a * b\n"


def _git(ws: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    return subprocess.run(
        ["git", "-C", str(ws), *args], check=True, capture_output=True, text=True, env=env
    ).stdout


def make_workspace(ws: Path) -> None:
    """The starting workspace: a single-commit repo with `mul` missing, visible test only."""
    ws.mkdir(parents=True, exist_ok=True)
    (ws / "calc.py").write_text(CALC)
    (ws / "tests").mkdir()
    (ws / "tests" / "test_add.py").write_text(VISIBLE_TEST)
    _git(ws, "init", "-q")
    _git(ws, "add", "-A")
    _git(ws, "commit", "-qm", "task")


def grade_patch(patch: str, scratch: Path) -> bool:
    """Apply `patch` to a fresh workspace, add the hidden test, run it: True when it passes."""
    ws = Path(tempfile.mkdtemp(prefix="grade-", dir=scratch)) / "ws"
    make_workspace(ws)
    if patch.strip():
        (ws / "model.patch").write_text(patch)
        r = subprocess.run(["git", "-C", str(ws), "apply", "model.patch"], capture_output=True)
        if r.returncode != 0:
            return False
    (ws / "tests" / "test_hidden.py").write_text(HIDDEN_TEST)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_hidden.py"],
        cwd=ws,
        capture_output=True,
    )
    return r.returncode == 0


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte-level alphabet: printable bytes map to themselves, the rest above 255."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_CHARS = _bytes_to_unicode()


def ids_of(tok, piece) -> list[int]:
    """Token ids of text (special tokens recognized, as a model emits them) or raw bytes."""
    if isinstance(piece, bytes):
        return [tok.token_to_id(BYTE_CHARS[b]) for b in piece]
    return tok.encode(piece, add_special_tokens=False).ids


class ScriptedPolicy:
    """A token-level policy replaying scripted replies: `script[e][t]` is episode e's reply at
    turn t, as text/bytes or a list of them; a ("length", reply) tuple ends it as truncated."""

    needs_token_ids = True

    def __init__(self, tok, script, logprob=-0.5):
        self.tok, self.script, self.logprob = tok, script, logprob
        self.turn = [0] * len(script)
        self.calls = []

    def generate(self, requests):
        from cadenza.agent.policies import PolicyOutput

        self.calls.append(len(requests))
        live = [e for e in range(len(self.script)) if self.turn[e] < len(self.script[e])]
        out = []
        for e, req in zip(live, requests):
            reply = self.script[e][self.turn[e]]
            self.turn[e] += 1
            finish = "stop"
            if isinstance(reply, tuple):
                finish, reply = reply
            parts = reply if isinstance(reply, list) else [reply]
            ids = [i for p in parts for i in ids_of(self.tok, p)]
            if finish == "stop":
                ids.append(self.tok.token_to_id("<|im_end|>"))
            if len(ids) > req.max_new_tokens:
                ids, finish = ids[: req.max_new_tokens], "length"
            text = self.tok.decode(ids, skip_special_tokens=False)
            out.append(PolicyOutput(text, finish, ids, [self.logprob] * len(ids)))
        return out


def bpe_tokenizer(vocab_size: int = 1200):
    """A small byte-level BPE trained here on the harness's own prompt text (short prompts
    keep the tiny model's tests fast), with the chat special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers.pre_tokenizers import ByteLevel

    from cadenza.agent.tools import Toolbox
    from cadenza.config.agent import DEFAULT_SYSTEM_PROMPT

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        DEFAULT_SYSTEM_PROMPT,
        CALC,
        VISIBLE_TEST,
        HIDDEN_TEST,
        "Implement mul(a, b) in calc.py.",
    ]
    corpus += [json.dumps(s["function"]) for s in Toolbox().schemas()]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=CHAT_SPECIALS,
        initial_alphabet=ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus * 4, trainer)
    return tok


def call(name, **args):
    """A well-formed tool call as the cadenza format writes it."""
    return "<|tool_call|>" + json.dumps({"name": name, "arguments": args}) + "<|/tool_call|>"


def scripted_generate(tok, replies):
    """A generate_fn replaying replies (as the sampler returns them: stop token kept)."""
    from cadenza.model import Generation

    queue = list(replies)
    end = tok.token_to_id("<|im_end|>")

    def generate(model, prompts, max_new_tokens, temperature, top_p, stop_tokens, seed):
        out = []
        for _ in prompts:
            ids = ids_of(tok, queue.pop(0)) + [end]
            out.append(Generation(ids, [-1.0] * len(ids), "stop"))
        return out

    return generate


SOLVE = [
    "Reading." + call("read_file", path="calc.py"),
    call(
        "str_replace", path="calc.py", old_str="raise NotImplementedError", new_str="return a * b"
    ),
    call("run_tests"),
    call("submit"),
]
