"""Text feedback: providers that read an episode and propose (turn, hint) pairs.

A provider is any object with a `name` and `hints(episode, ctx) -> list[Hint]`; register
new ones with `register_provider`. Each hint targets one assistant turn: the trainer inserts
the hint text at the message boundary before that turn to build the teacher's context
(rl/teacher.py). Hints are phrased as reminders a user could have given; they must not give
away the task's answer (`leaks_answer` filters them out).

Built-in providers:
- unknown_tool: a call to a tool that does not exist -> "Reminder: available tools: ...".
- invalid_arguments: a call whose arguments do not parse or miss required keys.
- repeated_failure: the same call issued again after it failed.
- ruff: style violations in Python files the agent wrote (ruff via subprocess; skipped
  cleanly when ruff is not installed).
- overlong: assistant messages longer than a budget.
- llm_judge: any OpenAI-compatible chat endpoint asked for hints (urllib, no dependency).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from cadenza.agent.episode import Episode, ToolCall, Turn


@dataclass(frozen=True)
class Hint:
    turn_index: int  # index into episode.turns; always an assistant turn
    text: str
    provider: str


@dataclass
class FeedbackContext:
    """What providers may know besides the episode."""

    # tool name -> JSON-schema-like spec of its arguments ({"required": [...], "properties": {...}})
    tools: dict[str, dict[str, Any]] = field(default_factory=dict)
    hidden_patch: str = ""  # the task's answer; hints overlapping it are dropped
    max_message_chars: int = 4000
    write_tools: tuple[str, ...] = ("write_file", "create_file")  # tools whose args hold a file
    errors: dict[str, int] = field(default_factory=dict)  # provider -> failures (never raised)


class FeedbackProvider(Protocol):
    name: str

    def hints(self, episode: Episode, ctx: FeedbackContext) -> list[Hint]: ...


def _call_text(call: ToolCall) -> str:
    return call.raw or f"{call.name}({json.dumps(call.arguments, sort_keys=True)})"


class UnknownTool:
    name = "unknown_tool"

    @staticmethod
    def hint_text(tools, unknown) -> str:
        listing = ", ".join(sorted(tools)) or "(none)"
        what = f" ({', '.join(sorted(set(unknown)))} does not exist)" if unknown else ""
        return f"Reminder: available tools: {listing}.{what}"

    def hints(self, episode: Episode, ctx: FeedbackContext) -> list[Hint]:
        out = []
        for i, turn in enumerate(episode.turns):
            if turn.role != "assistant":
                continue
            bad = [c.name for c in turn.tool_calls if ctx.tools and c.name not in ctx.tools]
            if bad or "unknown_tool" in turn.error_kinds:
                out.append(Hint(i, self.hint_text(ctx.tools, bad), self.name))
        return out


def _missing_required(call: ToolCall, spec: dict[str, Any]) -> list[str]:
    return [k for k in spec.get("required", []) if k not in (call.arguments or {})]


class InvalidArguments:
    name = "invalid_arguments"

    def hints(self, episode: Episode, ctx: FeedbackContext) -> list[Hint]:
        out = []
        for i, turn in enumerate(episode.turns):
            if turn.role != "assistant":
                continue
            for call in turn.tool_calls:
                spec = ctx.tools.get(call.name)
                if spec is None:
                    continue
                missing = _missing_required(call, spec)
                flagged = "invalid_arguments" in turn.error_kinds
                if call.arguments is None or missing or flagged:
                    props = ", ".join(spec.get("properties", {})) or "none"
                    req = ", ".join(spec.get("required", [])) or "none"
                    why = (
                        "could not be parsed as JSON"
                        if call.arguments is None
                        else (f"missing {', '.join(missing)}" if missing else "were rejected")
                    )
                    out.append(
                        Hint(
                            i,
                            f"Reminder: the arguments of {call.name} {why}; it takes a JSON "
                            f"object with keys: {props} (required: {req}).",
                            self.name,
                        )
                    )
                    break
        return out


_FAILURE = re.compile(r"(exit code [1-9]|Traceback|Error|error:|not found|No such file)")


def tool_failed(turn: Turn) -> bool:
    """A tool turn whose result reports a failure."""
    return bool(turn.error_kinds) or bool(_FAILURE.search(turn.observation or turn.text or ""))


def _first_line(text: str, limit: int = 160) -> str:
    line = next((s for s in text.splitlines() if s.strip()), "")
    return line[:limit]


class RepeatedFailure:
    name = "repeated_failure"

    def hints(self, episode: Episode, ctx: FeedbackContext) -> list[Hint]:
        out = []
        failed: dict[str, str] = {}  # call key -> failure message
        turns = episode.turns
        for i, turn in enumerate(turns):
            if turn.role != "assistant":
                continue
            keys = [(c.name, json.dumps(c.arguments, sort_keys=True)) for c in turn.tool_calls]
            repeats = [k for k in keys if "\0".join(k) in failed]
            if repeats:
                msg = failed["\0".join(repeats[0])]
                out.append(
                    Hint(
                        i,
                        f"Reminder: the call {repeats[0][0]} with these arguments already failed "
                        f"with: {msg}. Try a different approach.",
                        self.name,
                    )
                )
            results = []
            j = i + 1
            while j < len(turns) and turns[j].role == "tool":
                results.append(turns[j])
                j += 1
            for key, res in zip(keys, results):
                if tool_failed(res):
                    failed["\0".join(key)] = _first_line(res.observation or res.text)
        return out


def _ruff_command() -> list[str] | None:
    exe = shutil.which("ruff")
    if exe:
        return [exe]
    try:
        import ruff  # noqa: F401
    except ImportError:
        return None
    return [sys.executable, "-m", "ruff"]


class RuffStyle:
    """Ruff violations in Python files the agent wrote, hinted at the writing turn."""

    name = "ruff"

    def __init__(self, select: str = "E,F,W", max_items: int = 3, timeout: float = 20.0):
        self.select = select
        self.max_items = max_items
        self.timeout = timeout

    def hints(self, episode: Episode, ctx: FeedbackContext) -> list[Hint]:
        cmd = _ruff_command()
        if cmd is None:
            return []
        out = []
        for i, turn in enumerate(episode.turns):
            if turn.role != "assistant":
                continue
            for call in turn.tool_calls:
                args = call.arguments or {}
                path, content = args.get("path"), args.get("content")
                if call.name not in ctx.write_tools or not isinstance(content, str):
                    continue
                if not str(path or "").endswith(".py"):
                    continue
                problems = self._check(cmd, content, ctx)
                if problems:
                    shown = "; ".join(problems[: self.max_items])
                    out.append(Hint(i, f"Style: ruff reports in {path}: {shown}.", self.name))
                    break
        return out

    def _check(self, cmd: list[str], content: str, ctx: FeedbackContext) -> list[str]:
        with tempfile.TemporaryDirectory() as tmp:
            f = Path(tmp) / "written.py"
            f.write_text(content)
            try:
                r = subprocess.run(
                    [
                        *cmd,
                        "check",
                        "--no-cache",
                        "--isolated",
                        "--output-format=json",
                        f"--select={self.select}",
                        str(f),
                    ],
                    capture_output=True,
                    text=True,
                    timeout=self.timeout,
                    cwd=tmp,
                )
                items = json.loads(r.stdout or "[]")
            except (subprocess.TimeoutExpired, OSError, json.JSONDecodeError):
                ctx.errors[self.name] = ctx.errors.get(self.name, 0) + 1
                return []
        return [f"{d['code']} line {d['location']['row']}: {d['message']}" for d in items]


class Overlong:
    name = "overlong"

    def hints(self, episode: Episode, ctx: FeedbackContext) -> list[Hint]:
        limit = ctx.max_message_chars
        return [
            Hint(i, f"Reminder: keep each message under {limit} characters; be concise.", self.name)
            for i, t in enumerate(episode.turns)
            if t.role == "assistant" and len(t.text) > limit
        ]


JUDGE_PROMPT = """You review an AI coding agent's trajectory. For assistant turns that made a \
clear, local mistake (wrong tool, bad arguments, ignored an error), write one short reminder \
that would have prevented it, without revealing the solution. Answer with JSON only: \
{"hints": [{"turn": <turn index>, "hint": "<text>"}]}. Trajectory:
"""


class LLMJudge:
    """Hints from any OpenAI-compatible /v1/chat/completions endpoint."""

    name = "llm_judge"

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key_env: str = "OPENAI_API_KEY",
        timeout: float = 60.0,
        max_chars: int = 24000,
    ):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.api_key_env = api_key_env
        self.timeout = timeout
        self.max_chars = max_chars

    def _render(self, episode: Episode) -> str:
        lines = []
        for i, t in enumerate(episode.turns):
            body = t.text or t.observation or ""
            calls = " ".join(_call_text(c) for c in t.tool_calls)
            lines.append(f"[{i}] {t.role}: {body} {calls}".strip())
        return "\n".join(lines)[-self.max_chars :]

    def hints(self, episode: Episode, ctx: FeedbackContext) -> list[Hint]:
        payload = {
            "model": self.model,
            "messages": [{"role": "user", "content": JUDGE_PROMPT + self._render(episode)}],
            "temperature": 0.0,
        }
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.api_key_env)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(self.url, json.dumps(payload).encode(), headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                body = json.loads(resp.read().decode())
            content = body["choices"][0]["message"]["content"]
            found = json.loads(content[content.index("{") : content.rindex("}") + 1])["hints"]
        except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError):
            ctx.errors[self.name] = ctx.errors.get(self.name, 0) + 1
            return []
        out = []
        for h in found if isinstance(found, list) else []:
            try:
                i, text = int(h["turn"]), str(h["hint"]).strip()
            except (KeyError, TypeError, ValueError):
                continue
            if 0 <= i < len(episode.turns) and episode.turns[i].role == "assistant" and text:
                out.append(Hint(i, text, self.name))
        return out


PROVIDERS: dict[str, Callable[..., FeedbackProvider]] = {
    "unknown_tool": UnknownTool,
    "invalid_arguments": InvalidArguments,
    "repeated_failure": RepeatedFailure,
    "ruff": RuffStyle,
    "overlong": Overlong,
    "llm_judge": LLMJudge,
}


def register_provider(name: str, factory: Callable[..., FeedbackProvider]) -> None:
    PROVIDERS[name] = factory


def build_providers(names: list[str] | tuple[str, ...], **options: dict[str, Any]) -> list:
    """Providers by name; `options[name]` holds keyword arguments for that provider."""
    unknown = [n for n in names if n not in PROVIDERS]
    if unknown:
        raise ValueError(
            f"feedback providers: unknown {unknown}; expected some of {sorted(PROVIDERS)} "
            "(or register your own with cadenza.rl.feedback.register_provider)"
        )
    return [PROVIDERS[n](**options.get(n, {})) for n in names]


def _patch_added_lines(patch: str) -> list[str]:
    return [
        ln[1:].strip()
        for ln in patch.splitlines()
        if ln.startswith("+") and not ln.startswith("+++") and ln[1:].strip()
    ]


def leaks_answer(hint: str, hidden_patch: str, ngram: int = 6, min_line: int = 20) -> bool:
    """True when the hint quotes the answer: a whole added line of the hidden patch (at least
    `min_line` characters) or any run of `ngram` consecutive words from its added lines."""
    if not hidden_patch:
        return False
    added = _patch_added_lines(hidden_patch)
    if any(len(line) >= min_line and line in hint for line in added):
        return True
    words = hint.split()
    hint_grams = {tuple(words[i : i + ngram]) for i in range(len(words) - ngram + 1)}
    if not hint_grams:
        return False
    patch_words = " ".join(added).split()
    return any(
        tuple(patch_words[i : i + ngram]) in hint_grams for i in range(len(patch_words) - ngram + 1)
    )


def annotate(
    episode: Episode, providers: list, ctx: FeedbackContext
) -> tuple[list[Hint], dict[str, int]]:
    """All providers' hints, one merged hint per target turn; answer leaks dropped.

    Returns (hints sorted by turn, counts of dropped hints by reason). A provider that raises
    is counted in ctx.errors and skipped: feedback never stops a run.
    """
    by_turn: dict[int, list[Hint]] = {}
    dropped = {"leak": 0, "not_assistant": 0}
    for p in providers:
        try:
            found = p.hints(episode, ctx)
        except Exception:  # a plugin's bug must not kill training; it is counted
            ctx.errors[p.name] = ctx.errors.get(p.name, 0) + 1
            continue
        for h in found:
            if not (0 <= h.turn_index < len(episode.turns)) or (
                episode.turns[h.turn_index].role != "assistant"
            ):
                dropped["not_assistant"] += 1
            elif leaks_answer(h.text, ctx.hidden_patch):
                dropped["leak"] += 1
            else:
                by_turn.setdefault(h.turn_index, []).append(h)
    merged = [
        Hint(i, "\n".join(h.text for h in hs), "+".join(dict.fromkeys(h.provider for h in hs)))
        for i, hs in sorted(by_turn.items())
    ]
    return merged, dropped


def teacher_prefers_other(
    student_logprobs: list[float] | Any, teacher_logprobs: list[float] | Any, margin: float = 0.1
) -> tuple[bool, float]:
    """Keep a span only if the teacher prefers a different behavior by `margin`.

    gain = mean_i (log p(y_i) - log q(y_i)) over the student's sampled tokens y of the span:
    how much less likely the hinted teacher finds what the student did. Spans with gain below
    `margin` are ones where the hint changes nothing and are skipped. Returns (keep, gain).
    """
    s = [float(x) for x in student_logprobs]
    t = [float(x) for x in teacher_logprobs]
    if len(s) != len(t) or not s:
        return False, 0.0
    gain = sum(a - b for a, b in zip(s, t)) / len(s)
    return gain >= margin, gain
