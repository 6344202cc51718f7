"""The agent's tools: definitions in the OpenAI function-calling format and their execution.

Every call becomes an observation string and at most one error kind; nothing a policy sends
raises. File tools run in-process with paths confined to the workspace (symlinks resolved);
`search`, `run` and `run_tests` execute in the sandbox through `ToolContext.run_command`,
which has the signature of `cadenza.sandbox.run`.

Error kinds (recorded on the assistant turn, targeted by text feedback):
`unknown_tool`, `invalid_arguments`, `path_outside_workspace`, `tool_failed`.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cadenza.agent.json_schema import validate

UNKNOWN_TOOL = "unknown_tool"
INVALID_ARGUMENTS = "invalid_arguments"
PATH_OUTSIDE_WORKSPACE = "path_outside_workspace"
TOOL_FAILED = "tool_failed"


def _default_run_command(*args: Any, **kwargs: Any) -> Any:
    from cadenza.sandbox import run  # imported late: the sandbox is optional for file tools

    return run(*args, **kwargs)


@dataclass
class ToolContext:
    """Where and how tools run for one episode."""

    workspace: Path
    run_command: Callable[..., Any] = _default_run_command
    test_command: Sequence[str] = ("python", "-m", "pytest", "-q", "-x")
    command_timeout: float = 60.0
    test_timeout: float = 300.0
    memory_mb: int | None = None
    unsafe: bool = False  # passed to the sandbox: run without bubblewrap when it is missing
    max_observation_chars: int = 8000
    max_list_entries: int = 400
    env: dict[str, str] | None = None  # extra environment for sandboxed commands
    ro_binds: tuple[str, ...] = ()  # read-only paths commands need (the task's environment)


@dataclass
class ToolResult:
    observation: str
    error_kind: str | None = None
    done: bool = False  # the episode ends (submit)


class ToolError(Exception):
    """A tool could not do what was asked; the message is the observation."""

    def __init__(self, message: str, kind: str = TOOL_FAILED):
        super().__init__(message)
        self.kind = kind


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., str | ToolResult] = field(repr=False)

    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


def _obj(properties: dict[str, Any], required: Sequence[str] = ()) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


def clip(text: str, limit: int) -> str:
    """Keep the head and tail of `text` within `limit` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    half = max(limit // 2 - 40, 0)
    cut = len(text) - 2 * half
    return f"{text[:half]}\n[... {cut} characters omitted ...]\n{text[len(text) - half :]}"


def confine(ctx: ToolContext, path: str) -> Path:
    """The absolute path of `path` (relative to the workspace), refused if it leaves it."""
    root = ctx.workspace.resolve()
    if "\x00" in path:
        raise ToolError(f"path {path!r} contains a NUL byte", INVALID_ARGUMENTS)
    p = Path(path)
    target = (p if p.is_absolute() else root / p).resolve()
    if target != root and not target.is_relative_to(root):
        raise ToolError(
            f"path {path!r} is outside the workspace; use a path relative to the workspace root",
            PATH_OUTSIDE_WORKSPACE,
        )
    return target


def _rel(ctx: ToolContext, p: Path) -> str:
    return str(p.relative_to(ctx.workspace.resolve())) or "."


def _sandboxed(ctx: ToolContext, argv: list[str], timeout: float) -> Any:
    extra: dict[str, Any] = {}
    if ctx.env:
        extra["env"] = ctx.env
    if ctx.ro_binds:
        extra["ro_binds"] = ctx.ro_binds
    return ctx.run_command(
        argv, ctx.workspace, timeout=timeout, memory_mb=ctx.memory_mb, unsafe=ctx.unsafe, **extra
    )


def _text(v: Any) -> str:
    if isinstance(v, bytes):
        return v.decode("utf-8", errors="replace")
    return v or ""


def _format_process(res: Any, timeout: float) -> str:
    parts = [f"exit code: {res.returncode}"]
    if getattr(res, "timed_out", False):
        parts[0] += f" (killed: timed out after {timeout:g} s)"
    out, err = _text(res.stdout), _text(res.stderr)
    if out:
        parts.append("stdout:\n" + out.rstrip("\n"))
    if err:
        parts.append("stderr:\n" + err.rstrip("\n"))
    if getattr(res, "truncated", False):
        parts.append("[output truncated by the sandbox]")
    return "\n".join(parts)


# --- tool implementations ---------------------------------------------------------------


def list_dir(ctx: ToolContext, path: str = ".") -> str:
    d = confine(ctx, path)
    if not d.is_dir():
        raise ToolError(f"{path!r} is not a directory")
    entries = []
    for e in sorted(d.iterdir(), key=lambda e: e.name):
        if e.name == ".git":
            continue
        entries.append(e.name + ("/" if e.is_dir() else ""))
    more = len(entries) - ctx.max_list_entries
    out = "\n".join(entries[: ctx.max_list_entries]) or "(empty directory)"
    return out + (f"\n[... {more} more entries]" if more > 0 else "")


def read_file(ctx: ToolContext, path: str, start_line: int = 1, end_line: int | None = None) -> str:
    f = confine(ctx, path)
    if not f.is_file():
        raise ToolError(f"{path!r} is not a file; list_dir shows what exists")
    data = f.read_bytes()
    if b"\x00" in data[:8192]:
        return f"{path}: binary file, {len(data)} bytes"
    lines = data.decode("utf-8", errors="replace").splitlines()
    if end_line is not None and end_line < start_line:
        raise ToolError(f"end_line={end_line} is before start_line={start_line}", INVALID_ARGUMENTS)
    stop = len(lines) if end_line is None else min(end_line, len(lines))
    if start_line > max(len(lines), 1):
        raise ToolError(f"start_line={start_line} is past the end ({len(lines)} lines)")
    width = len(str(stop))
    body = "\n".join(f"{i:>{width}}\t{lines[i - 1]}" for i in range(start_line, stop + 1))
    return body if body else f"{path}: empty file"


def write_file(ctx: ToolContext, path: str, content: str) -> str:
    f = confine(ctx, path)
    if f.is_dir():
        raise ToolError(f"{path!r} is a directory")
    f.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(f, content)
    return f"wrote {len(content)} characters to {_rel(ctx, f)}"


def _atomic_write(f: Path, content: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=f.parent, prefix=f".{f.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", errors="surrogatepass", newline="") as h:
            h.write(content)
        if f.exists():
            os.chmod(tmp, f.stat().st_mode & 0o777)
        os.replace(tmp, f)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def str_replace(ctx: ToolContext, path: str, old_str: str, new_str: str) -> str:
    f = confine(ctx, path)
    if not f.is_file():
        raise ToolError(f"{path!r} is not a file; use write_file to create it")
    text = f.read_text(encoding="utf-8", errors="replace")
    n = text.count(old_str)
    if n == 0:
        raise ToolError(f"old_str not found in {path}; read_file shows the exact text")
    if n > 1:
        raise ToolError(
            f"old_str occurs {n} times in {path}; include more context to make it unique"
        )
    _atomic_write(f, text.replace(old_str, new_str, 1))
    return f"replaced 1 occurrence in {_rel(ctx, f)}"


def search(ctx: ToolContext, pattern: str, path: str = ".") -> str:
    target = confine(ctx, path)
    argv = ["grep", "-rnI", "-E", "--exclude-dir=.git", "-m", "50", "-e", pattern, "--"]
    if target != ctx.workspace.resolve():
        argv.append(_rel(ctx, target))
    res = _sandboxed(ctx, argv, ctx.command_timeout)
    if res.returncode == 1:
        return f"no matches for {pattern!r}"
    if res.returncode != 0:
        raise ToolError(f"search failed: {_text(res.stderr).strip() or res.returncode}")
    return _text(res.stdout).rstrip("\n")


def run(ctx: ToolContext, command: str, timeout: int | None = None) -> str:
    limit = min(float(timeout), ctx.command_timeout) if timeout else ctx.command_timeout
    res = _sandboxed(ctx, ["bash", "-c", command], limit)
    return _format_process(res, limit)


def run_tests(ctx: ToolContext, path: str | None = None) -> str:
    argv = list(ctx.test_command)
    if path is not None:
        argv.append(_rel(ctx, confine(ctx, path)))
    res = _sandboxed(ctx, argv, ctx.test_timeout)
    return _format_process(res, ctx.test_timeout)


def submit(ctx: ToolContext, summary: str = "") -> ToolResult:
    return ToolResult("submitted; the episode ends and the workspace is graded", done=True)


_PATH = {"type": "string", "description": "Path relative to the workspace root."}

TOOLS: list[Tool] = [
    Tool(
        "list_dir",
        "List the entries of a directory in the workspace (directories end with /).",
        _obj({"path": _PATH}),
        list_dir,
    ),
    Tool(
        "read_file",
        "Read a text file with line numbers, optionally a line range (1-based, inclusive).",
        _obj(
            {
                "path": _PATH,
                "start_line": {"type": "integer", "minimum": 1},
                "end_line": {"type": "integer", "minimum": 1},
            },
            ["path"],
        ),
        read_file,
    ),
    Tool(
        "write_file",
        "Create or overwrite a file with the given content.",
        _obj({"path": _PATH, "content": {"type": "string"}}, ["path", "content"]),
        write_file,
    ),
    Tool(
        "str_replace",
        "Replace the one occurrence of old_str in a file by new_str.",
        _obj(
            {
                "path": _PATH,
                "old_str": {"type": "string", "minLength": 1},
                "new_str": {"type": "string"},
            },
            ["path", "old_str", "new_str"],
        ),
        str_replace,
    ),
    Tool(
        "search",
        "Search files for an extended regular expression (grep -E); prints file:line:text.",
        _obj({"pattern": {"type": "string", "minLength": 1}, "path": _PATH}, ["pattern"]),
        search,
    ),
    Tool(
        "run",
        "Run a shell command in the workspace (sandboxed, no network); prints its exit code and output.",
        _obj(
            {
                "command": {"type": "string", "minLength": 1},
                "timeout": {"type": "integer", "minimum": 1},
            },
            ["command"],
        ),
        run,
    ),
    Tool(
        "run_tests",
        "Run the project's visible tests, or only those under a path.",
        _obj({"path": _PATH}),
        run_tests,
    ),
    Tool(
        "submit",
        "Finish: the current state of the workspace is your answer.",
        _obj({"summary": {"type": "string"}}),
        submit,
    ),
]


class Toolbox:
    """A set of tools: their schemas for the prompt, and `call` that never raises."""

    def __init__(self, tools: Sequence[Tool] = TOOLS):
        self.tools = {t.name: t for t in tools}

    @property
    def names(self) -> list[str]:
        return list(self.tools)

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tools.values()]

    def check(self, name: Any, arguments: Any) -> ToolResult | None:
        """The error result for a call that cannot run (unknown tool, bad arguments), else None."""
        tool = self.tools.get(name) if isinstance(name, str) else None
        if tool is None:
            return ToolResult(
                f"Tool not found: {name}. Available tools: {', '.join(self.names)}", UNKNOWN_TOOL
            )
        errors = validate(arguments, tool.parameters)
        if errors:
            return ToolResult(
                f"Invalid arguments for {name}: " + "; ".join(errors[:5]), INVALID_ARGUMENTS
            )
        return None

    def call(self, name: Any, arguments: Any, ctx: ToolContext) -> ToolResult:
        bad = self.check(name, arguments)
        if bad is not None:
            return bad
        try:
            out = self.tools[name].fn(ctx, **arguments)
        except ToolError as e:
            return ToolResult(clip(f"Error: {e}", ctx.max_observation_chars), e.kind)
        except (OSError, UnicodeError, ValueError) as e:
            return ToolResult(
                clip(f"Error: {name} failed: {e}", ctx.max_observation_chars), TOOL_FAILED
            )
        if isinstance(out, ToolResult):
            return out
        return ToolResult(clip(out, ctx.max_observation_chars))
