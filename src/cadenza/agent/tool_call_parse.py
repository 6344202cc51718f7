"""Tool calls parsed from generated text, robustly: whatever the text, a result, never a raise.

A call is `OPEN {"name": NAME, "arguments": {...}} CLOSE` (the cadenza template's tags, or a
checkpoint's, e.g. Hermes/Qwen `<tool_call>...</tool_call>`). `arguments` may also be a JSON
string holding the object (the OpenAI wire form) or be called `parameters`. Every problem
becomes a `Problem` with an error kind and a message the policy will read as its observation.

Error kinds: `malformed_json`, `malformed_call` (JSON, but not a call), `unclosed_call`,
`invalid_arguments`, `oversized_call`, `too_many_calls`, `invalid_utf8`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from cadenza.agent.episode import ToolCall

MALFORMED_JSON = "malformed_json"
MALFORMED_CALL = "malformed_call"
UNCLOSED_CALL = "unclosed_call"
INVALID_ARGUMENTS = "invalid_arguments"
OVERSIZED_CALL = "oversized_call"
TOO_MANY_CALLS = "too_many_calls"
INVALID_UTF8 = "invalid_utf8"

_NAME_RE = re.compile(r'"name"\s*:\s*"([^"\\]{1,100})"')


@dataclass
class Problem:
    kind: str
    message: str
    call_index: int | None = None  # which entry of ParsedOutput.calls it concerns


@dataclass
class ParsedOutput:
    content: str  # the text outside the calls
    calls: list[ToolCall] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    @property
    def error_kinds(self) -> list[str]:
        return list(dict.fromkeys(p.kind for p in self.problems))

    def problem_for(self, i: int) -> Problem | None:
        return next((p for p in self.problems if p.call_index == i), None)


def _has_surrogates(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _short(text: str, n: int = 200) -> str:
    return text if len(text) <= n else text[:n] + f"... ({len(text)} characters)"


def parse_call(body: str, index: int, max_call_chars: int) -> tuple[ToolCall, Problem | None]:
    """One call's body (the text between the tags) as a ToolCall and its problem, if any."""
    raw = body
    if len(body) > max_call_chars:
        m = _NAME_RE.search(body[:1000])
        name = m.group(1) if m else ""
        msg = (
            f"tool call {name or '?'} is {len(body)} characters long; the limit is "
            f"{max_call_chars}. Write large files in several smaller calls."
        )
        return ToolCall(name, None, _short(raw, 1000), f"call_{index}"), Problem(
            OVERSIZED_CALL, msg, index
        )
    text = body.strip()
    if not text:
        return ToolCall("", None, raw, f"call_{index}"), Problem(
            MALFORMED_CALL,
            'empty tool call; expected {"name": ..., "arguments": {...}} between the tags',
            index,
        )
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        m = _NAME_RE.search(text)
        detail = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deeply"
        pos = f" at character {e.pos}" if isinstance(e, json.JSONDecodeError) else ""
        return ToolCall(m.group(1) if m else "", None, raw, f"call_{index}"), Problem(
            MALFORMED_JSON,
            f"tool call is not valid JSON ({detail}{pos}): {_short(text, 120)!r}. "
            'Expected {"name": ..., "arguments": {...}}',
            index,
        )
    if not isinstance(obj, dict):
        return ToolCall("", None, raw, f"call_{index}"), Problem(
            MALFORMED_CALL,
            f'tool call must be a JSON object {{"name": ..., "arguments": {{...}}}}, '
            f"found {type(obj).__name__}",
            index,
        )
    if isinstance(obj.get("function"), dict):  # {"type": "function", "function": {...}}
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall("", None, raw, f"call_{index}"), Problem(
            MALFORMED_CALL,
            f'tool call needs "name" (a string), found {_short(repr(name), 60)}',
            index,
        )
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            return ToolCall(name, None, raw, f"call_{index}"), Problem(
                INVALID_ARGUMENTS,
                f"arguments of {name} are a string that is not a JSON object: {_short(args, 120)!r}",
                index,
            )
    if not isinstance(args, dict):
        return ToolCall(name, None, raw, f"call_{index}"), Problem(
            INVALID_ARGUMENTS,
            f"arguments of {name}: expected an object, found {type(args).__name__}",
            index,
        )
    if _has_surrogates(args) or _has_surrogates(name):
        return ToolCall(name, None, raw, f"call_{index}"), Problem(
            INVALID_UTF8,
            f"arguments of {name} contain unpaired surrogates (not valid UTF-8)",
            index,
        )
    return ToolCall(name, args, raw, f"call_{index}"), None


def parse_tool_calls(
    text: str | bytes,
    open_tag: str = "<|tool_call|>",
    close_tag: str = "<|/tool_call|>",
    *,
    max_call_chars: int = 256_000,
    max_calls: int = 16,
) -> ParsedOutput:
    """All calls in `text` and every problem found; content is the text outside calls."""
    problems: list[Problem] = []
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError:
            text = bytes(text).decode("utf-8", errors="replace")
    if not isinstance(text, str):
        text = str(text)
    if "\ufffd" in text:
        problems.append(
            Problem(
                INVALID_UTF8,
                "the output contained bytes that are not valid UTF-8 (shown as \ufffd)",
            )
        )
    bodies: list[tuple[str, bool]] = []  # (body, closed)
    content: list[str] = []
    pos = 0
    while True:
        i = text.find(open_tag, pos)
        if i < 0:
            content.append(text[pos:])
            break
        content.append(text[pos:i])
        start = i + len(open_tag)
        j = text.find(close_tag, start)
        k = text.find(open_tag, start)
        if j < 0 or (0 <= k < j):  # unclosed: runs to the end or to the next opening tag
            end = len(text) if k < 0 else k
            bodies.append((text[start:end], False))
            pos = end
        else:
            bodies.append((text[start:j], True))
            pos = j + len(close_tag)
    rest = "".join(content)
    if close_tag in rest:
        problems.append(Problem(MALFORMED_CALL, f"found {close_tag} without a matching {open_tag}"))
    calls: list[ToolCall] = []
    for body, closed in bodies:
        if len(calls) >= max_calls:
            problems.append(
                Problem(
                    TOO_MANY_CALLS,
                    f"{len(bodies)} tool calls in one turn; only the first {max_calls} were run",
                )
            )
            break
        idx = len(calls)
        call, problem = parse_call(body, idx, max_call_chars)
        if not closed:
            if problem is None:  # complete JSON, missing tag: run it, but flag the turn
                problems.append(Problem(UNCLOSED_CALL, f"tool call not closed with {close_tag}"))
            else:
                problem = Problem(
                    UNCLOSED_CALL,
                    f"tool call not closed with {close_tag} and incomplete: {problem.message}",
                    idx,
                )
        calls.append(call)
        if problem is not None:
            problems.append(problem)
    return ParsedOutput(rest, calls, problems)
