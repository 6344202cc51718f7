"""Agent-driven feature removal: an OpenAI-compatible chat model deletes the feature with tools.

The second removal strategy behind the same gates (the first is `remove.py`'s exact ast
spans). The model edits a copy of the scrubbed workspace from which the hidden tests are
already gone; it is told the feature (name, file, definitions), the hidden tests that must
start failing, and that every test left in the workspace must keep passing. Whatever library
files it changed or deleted are the removal; `gates.validate` then judges it exactly like an
ast removal. Only the standard library talks to the endpoint (urllib): `cadenza.tasks` imports
neither torch nor `cadenza.agent`.

Tools: list_dir, read_file, write_file, str_replace, delete_file, run_tests, done. Only
existing library files may be written or deleted (tests, configs and new files are refused),
so the diff is always a removal from the project's own code. A malformed or refused tool call
is answered with an error observation; the conversation goes on until `done` or a limit.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from cadenza.tasks.discover import Feature
from cadenza.tasks.errors import TaskError
from cadenza.tasks.remove import RemovalError
from cadenza.tasks.testrun import TestRun

READ_LIMIT = 60_000  # characters of one read_file answer
RUN_REPORT_LIMIT = 4_000
FATAL_HTTP = {401, 403, 404}  # wrong key, URL or model: no candidate can succeed


class EndpointError(TaskError):
    """The chat endpoint cannot be used at all (unreachable, HTTP error, not chat JSON):
    every candidate would fail the same way, so the build stops."""


class AgentRemovalError(RemovalError):
    """The model did not produce a removal (gave up, ran out of turns/tokens/time)."""


@dataclass
class AgentRemoverOptions:
    endpoint: str  # e.g. http://127.0.0.1:8000/v1 (or the full .../chat/completions URL)
    model: str
    api_key_env: str = "OPENAI_API_KEY"  # read at call time, never stored in outputs
    max_turns: int = 40  # model calls per candidate
    max_tokens: int = 100_000  # completion tokens per candidate (usage, else chars / 4)
    max_seconds: float = 900.0  # wall clock per candidate, test runs included
    max_new_tokens: int = 4096  # per model call
    temperature: float = 0.0
    request_timeout: float = 300.0  # seconds per HTTP request


def chat_url(endpoint: str) -> str:
    base = endpoint.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise TaskError(
            f"--endpoint {endpoint!r}: expected an http(s) URL of an OpenAI-compatible server, "
            "e.g. http://127.0.0.1:8000/v1"
        )
    if base.endswith("/chat/completions"):
        return base
    return base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")


def chat(url: str, body: dict[str, Any], api_key: str | None, timeout: float) -> dict[str, Any]:
    """One non-streaming chat completion; returns the first choice's message and usage."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:300]
        message = f"the remover endpoint {url} answered HTTP {e.code}: {detail}"
        if e.code in FATAL_HTTP:
            raise EndpointError(message + "; check --endpoint, --model and the API key") from e
        raise AgentRemovalError(message) from e  # e.g. this candidate's context is too long
    except (urllib.error.URLError, OSError) as e:
        if isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError):
            raise AgentRemovalError(
                f"the remover endpoint {url} gave no answer within {timeout:.3g}s"
            ) from e
        raise EndpointError(
            f"cannot reach the remover endpoint {url}: {getattr(e, 'reason', e)}; start the "
            "server or fix --endpoint"
        ) from e
    try:
        data = json.loads(raw)
        message = data["choices"][0]["message"]
        if not isinstance(message, dict):
            raise TypeError("message is not an object")
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise EndpointError(
            f"the remover endpoint {url} did not answer with a chat completion "
            f"(expected choices[0].message, found {raw[:200]!r}): {e}"
        ) from e
    return {"message": message, "usage": data.get("usage") or {}}


def _param(kind: str, doc: str) -> dict[str, str]:
    return {"type": kind, "description": doc}


def _tool(name: str, doc: str, props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": doc,
            "parameters": {"type": "object", "properties": props, "required": required},
        },
    }


PATH = _param("string", "path relative to the workspace root")
TOOLS = [
    _tool("list_dir", "List a directory of the workspace.", {"path": PATH}, []),
    _tool(
        "read_file",
        "Read a file (optionally lines start_line..end_line, 1-based, inclusive).",
        {
            "path": PATH,
            "start_line": _param("integer", "first line"),
            "end_line": _param("integer", "last line"),
        },
        ["path"],
    ),
    _tool(
        "write_file",
        "Replace the whole content of an existing library file.",
        {"path": PATH, "content": _param("string", "the new content")},
        ["path", "content"],
    ),
    _tool(
        "str_replace",
        "Replace the one occurrence of old_str in a library file by new_str (may be empty).",
        {
            "path": PATH,
            "old_str": _param("string", "exact text, occurring exactly once"),
            "new_str": _param("string", "replacement text"),
        },
        ["path", "old_str", "new_str"],
    ),
    _tool("delete_file", "Delete a library file (a whole module).", {"path": PATH}, ["path"]),
    _tool("run_tests", "Run the visible test suite and report what fails.", {}, []),
    _tool("done", "Finish: the feature is removed and the visible tests pass.", {}, []),
]


class ToolError(ValueError):
    """A refused or malformed tool call; its message goes back to the model."""


class RemovalTools:
    """The tool set over one workspace copy; `editable` are the library files (posix paths)."""

    def __init__(self, root: Path, editable: set[str], run_visible: Callable[[], str]):
        self.root, self.editable, self.run_visible = root.resolve(), set(editable), run_visible
        self.finished = False

    def _rel(self, path: Any) -> str:
        if not isinstance(path, str) or not path.strip():
            raise ToolError(f"path: expected a non-empty string, found {path!r}")
        p = PurePosixPath(path.strip())
        if p.is_absolute() or ".." in p.parts or ".git" in p.parts:
            raise ToolError(f"path {path!r}: expected a relative path inside the workspace")
        rel = p.as_posix()
        return "." if rel in ("", ".") else rel

    def _editable(self, path: Any) -> Path:
        rel = self._rel(path)
        if rel not in self.editable:
            raise ToolError(
                f"{rel}: only existing library files may be changed or deleted "
                "(tests, configuration and new files may not)"
            )
        full = self.root / rel
        if not full.is_file():
            raise ToolError(f"{rel}: no such file (deleted already?)")
        return full

    def call(self, name: str, args: dict[str, Any]) -> str:
        fn = getattr(self, f"tool_{name}", None)
        if fn is None:
            raise ToolError(
                f"unknown tool {name!r}; expected one of "
                + ", ".join(t["function"]["name"] for t in TOOLS)
            )
        try:
            return fn(**args)
        except TypeError as e:
            raise ToolError(f"{name}: bad arguments {sorted(args)}: {e}") from e

    def tool_list_dir(self, path: str = ".") -> str:
        full = self.root / self._rel(path)
        if not full.is_dir():
            raise ToolError(f"{path}: not a directory")
        names = sorted(
            p.name + ("/" if p.is_dir() else "")
            for p in full.iterdir()
            if p.name not in (".git", ".cadenza-run")
        )
        return "\n".join(names) or "(empty)"

    def tool_read_file(self, path: str, start_line: int = 1, end_line: int | None = None) -> str:
        full = self.root / self._rel(path)
        if not full.is_file():
            raise ToolError(f"{path}: no such file")
        lines = full.read_text(errors="replace").splitlines(keepends=True)
        try:
            lo = max(1, int(start_line))
            hi = len(lines) if end_line is None else min(len(lines), int(end_line))
        except (TypeError, ValueError) as e:
            raise ToolError(f"start_line/end_line: expected integers ({e})") from e
        text = "".join(lines[lo - 1 : hi])
        if len(text) > READ_LIMIT:
            return text[:READ_LIMIT] + "\n[... cut: read a line range to see the rest]"
        return text

    def tool_write_file(self, path: str, content: str) -> str:
        full = self._editable(path)
        if not isinstance(content, str):
            raise ToolError("content: expected a string")
        full.write_text(content)
        return f"wrote {self._rel(path)} ({len(content.splitlines())} lines)"

    def tool_str_replace(self, path: str, old_str: str, new_str: str) -> str:
        full = self._editable(path)
        if not isinstance(old_str, str) or not isinstance(new_str, str) or not old_str:
            raise ToolError("old_str (non-empty) and new_str: expected strings")
        text = full.read_text()
        n = text.count(old_str)
        if n != 1:
            raise ToolError(
                f"old_str occurs {n} times in {self._rel(path)}; expected exactly once "
                "(include more surrounding lines)"
            )
        full.write_text(text.replace(old_str, new_str))
        return f"edited {self._rel(path)}"

    def tool_delete_file(self, path: str) -> str:
        self._editable(path).unlink()
        return f"deleted {self._rel(path)}"

    def tool_run_tests(self) -> str:
        return self.run_visible()

    def tool_done(self) -> str:
        self.finished = True
        return "done"


def instructions(feature: Feature, hidden: list[str]) -> list[dict[str, str]]:
    """The system and user messages that say what to remove and what must hold afterwards."""
    if feature.kind == "module":
        what = (
            f"the whole module `{feature.module}` (file {feature.file}): delete the file and "
            "every import of it or of its names in other library modules"
        )
    else:
        head = feature.defs[0]
        what = (
            f"the {feature.kind} `{feature.name}` defined in {feature.file} "
            f"(lines {head.start}-{head.end}, `{head.signature}`)"
        )
        helpers = feature.defs[1:]
        if helpers:
            what += ", with the private helpers only it uses: " + ", ".join(
                f"`{d.name}` (lines {d.start}-{d.end})" for d in helpers
            )
    system = (
        "You remove one feature from a Python project so that a developer can later be asked "
        "to re-implement it. Work only with the tools. Edit library code only; never edit, "
        "add or delete tests or configuration. Delete the code completely: leave no copy, "
        "comment or docstring of it behind."
    )
    user = (
        f"Remove {what}. Also remove its re-exports (imports in other modules, `__all__` "
        "entries) and module-level aliases of it, and nothing else.\n\n"
        "These hidden tests exercise the feature; they are not in the workspace and must FAIL "
        "once it is gone:\n"
        + "\n".join(f"- {t}" for t in hidden)
        + "\n\nEvery test still in the workspace must keep passing: check with run_tests. "
        "Call done when finished."
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


@dataclass
class AgentRemoval:
    changes: dict[str, str | None]  # library file -> new text (None: deleted)
    turns: int
    completion_tokens: int
    seconds: float
    tool_errors: int


def _normal_call(call: Any, default_id: str) -> tuple[dict[str, Any], str | None]:
    """An OpenAI tool call in canonical form, and what is wrong with it (None: nothing)."""
    c = call if isinstance(call, dict) else {}
    fn = c.get("function") if isinstance(c.get("function"), dict) else {}
    name, args = fn.get("name"), fn.get("arguments")
    problem = None
    if not isinstance(name, str) or not name:
        problem = "malformed tool call: expected {function: {name, arguments}}"
    canonical = {
        "id": c.get("id") if isinstance(c.get("id"), str) and c.get("id") else default_id,
        "type": "function",
        "function": {
            "name": name if isinstance(name, str) else "",
            "arguments": args if isinstance(args, str) else json.dumps(args or {}),
        },
    }
    return canonical, problem


def _arguments(raw: str) -> dict[str, Any]:
    if not raw.strip():
        return {}
    try:
        args = json.loads(raw)
    except (TypeError, ValueError) as e:
        raise ToolError(f"arguments are not valid JSON ({e}); send a JSON object") from e
    if not isinstance(args, dict):
        raise ToolError(f"arguments: expected a JSON object, found {type(args).__name__}")
    return args


def remove_with_agent(
    workspace: Path,
    feature: Feature,
    hidden: list[str],
    originals: dict[str, str],
    options: AgentRemoverOptions,
    run_visible: Callable[[], str],
    *,
    chat_fn: Callable[..., dict[str, Any]] = chat,
) -> AgentRemoval:
    """Let the model edit `workspace` (a copy whose library files are `originals`); returns
    the library files it changed. Raises AgentRemovalError when it does not finish within the
    limits or changes nothing, EndpointError when the endpoint cannot be used."""
    url = chat_url(options.endpoint)
    api_key = os.environ.get(options.api_key_env) if options.api_key_env else None
    tools = RemovalTools(workspace, set(originals), run_visible)
    messages: list[dict[str, Any]] = instructions(feature, hidden)
    t0 = time.monotonic()
    turns = tokens = tool_errors = 0
    while not tools.finished:
        if turns >= options.max_turns:
            raise AgentRemovalError(f"agent remover did not call done within {turns} turns")
        if tokens >= options.max_tokens:
            raise AgentRemovalError(
                f"agent remover used {tokens} completion tokens (limit {options.max_tokens}) "
                "without calling done"
            )
        left = options.max_seconds - (time.monotonic() - t0)
        if left <= 0:
            raise AgentRemovalError(
                f"agent remover did not call done within {options.max_seconds:.0f}s"
            )
        body = {
            "model": options.model,
            "messages": messages,
            "tools": TOOLS,
            "max_tokens": options.max_new_tokens,
            "temperature": options.temperature,
        }
        answer = chat_fn(url, body, api_key, min(options.request_timeout, left))
        turns += 1
        msg, usage = answer["message"], answer["usage"]
        raw_calls = msg.get("tool_calls") or []
        calls = [_normal_call(c, f"call_{turns}_{i}") for i, c in enumerate(raw_calls)]
        content = msg.get("content") if isinstance(msg.get("content"), str) else ""
        used = usage.get("completion_tokens")
        tokens += int(used) if isinstance(used, int) else (len(content) + len(str(calls))) // 4
        # history carries the calls well-formed, so a strict server accepts the next request
        messages.append(
            {"role": "assistant", "content": content, "tool_calls": [c for c, _ in calls]}
            if calls
            else {"role": "assistant", "content": content}
        )
        if not calls:
            tool_errors += 1
            messages.append(
                {
                    "role": "user",
                    "content": "error: no tool call found; use the tools, and call done when "
                    "the feature is removed",
                }
            )
            continue
        for call, problem in calls:
            try:
                if problem:
                    raise ToolError(problem)
                fn = call["function"]
                observation = tools.call(fn["name"], _arguments(fn["arguments"]))
            except (ToolError, OSError, UnicodeError) as e:
                tool_errors += 1
                observation = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": observation})
            if tools.finished:
                break
    changes: dict[str, str | None] = {}
    for rel, text in originals.items():
        path = workspace / rel
        if not path.is_file():
            changes[rel] = None
        elif (new := path.read_text()) != text:
            changes[rel] = new
    if not changes:
        raise AgentRemovalError("agent remover called done without changing any library file")
    return AgentRemoval(changes, turns, tokens, time.monotonic() - t0, tool_errors)


def summarize_run(run: TestRun, expected: list[str]) -> str:
    """What run_tests tells the model: the visible tests that should pass but do not."""
    if run.timed_out:
        return "the test run timed out"
    lines = []
    if run.collect_errors:
        lines.append("collection errors in: " + ", ".join(run.collect_errors[:10]))
    bad = [t for t in expected if run.outcomes.get(t) != "passed"]
    ok = len(expected) - len(bad)
    lines.append(f"{ok} of {len(expected)} visible tests pass")
    lines += [f"FAILING {t} ({run.outcomes.get(t, 'absent')})" for t in bad[:30]]
    if bad or run.collect_errors:
        lines.append("output tail:\n" + run.output[-RUN_REPORT_LIMIT:])
    return "\n".join(lines)


__all__ = [
    "TOOLS",
    "AgentRemoval",
    "AgentRemovalError",
    "AgentRemoverOptions",
    "EndpointError",
    "RemovalTools",
    "chat",
    "chat_url",
    "instructions",
    "remove_with_agent",
]
