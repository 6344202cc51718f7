"""The episode runner: a group of episodes on one task, turn by turn, then graded.

Per turn, one `policy.generate` call serves every live episode of the group (batched on the
local sampler). Each output becomes a recorded assistant turn (tokens, logprobs, mask,
parsed calls, error kinds), its calls run as tools, and each result becomes a tool turn;
an output without a call gets a user turn saying so. Limits: assistant turns, sampled
tokens per turn and per episode, and the whole sequence's length. At the end, each
workspace's diff against the starting commit is the model_patch, graded by the task.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cadenza.agent.chat_format import ChatFormat
from cadenza.agent.episode import Episode, Turn
from cadenza.agent.policies import PolicyOutput, PolicyRequest
from cadenza.agent.tool_call_parse import parse_tool_calls
from cadenza.agent.tools import Toolbox, ToolContext
from cadenza.config.agent import AgentConfig

NO_TOOL_CALL = "no_tool_call"
EMPTY_RESPONSE = "empty_response"
TRUNCATED = "truncated"
POLICY_ERROR = "policy_error"


@dataclass
class GradeResult:
    resolved: bool
    reward: float
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class AgentTask:
    """What the runner needs of a task: a starting workspace, a statement, a grader."""

    instance_id: str
    problem_statement: str
    prepare_workspace: Callable[[Path], None]  # writes the starting repo (one commit) there
    grade: Callable[[str], GradeResult | bool | float] | None = None  # model_patch -> result
    test_command: Sequence[str] = ("python", "-m", "pytest", "-q", "-x")
    env: dict[str, str] | None = None  # environment for commands (e.g. the project's venv)
    ro_binds: tuple[str, ...] = ()  # paths commands read (the task's environment)


def _as_grade(r: GradeResult | bool | float) -> GradeResult:
    if isinstance(r, GradeResult):
        return r
    if isinstance(r, bool):
        return GradeResult(r, float(r))
    return GradeResult(float(r) >= 1.0, float(r))


def user_prompt(task: AgentTask) -> str:
    return (
        f"{task.problem_statement.strip()}\n\nThe repository is your working directory. "
        "Make the change, check it with run_tests, then call submit."
    )


def no_call_feedback(tools: Sequence[str], empty: bool) -> str:
    head = "Your reply was empty." if empty else "Your reply contained no tool call."
    return f"{head} Call one of the tools ({', '.join(tools)}); call submit when you are done."


PATCH_SCRIPT = (
    'set -e; idx=$(mktemp); cp .git/index "$idx" 2>/dev/null || true; '
    'export GIT_INDEX_FILE="$idx"; '
    "git add -A -- . ':(exclude,glob)**/__pycache__/**' ':(exclude,glob)**/*.pyc' "
    "':(exclude).pytest_cache' ':(exclude,glob)**/.pytest_cache/**'; "
    'git -c core.quotepath=off diff --cached --binary HEAD > .git/cadenza_model.patch; rm -f "$idx"'
)


def workspace_patch(ctx: ToolContext) -> str:
    """`git diff` of the workspace against its starting commit, new files included.

    Runs in the sandbox: the workspace's .git is writable by the policy's commands, so its
    hooks and config are untrusted. The patch goes to a file (stdout is capped).
    """
    res = ctx.run_command(
        ["bash", "-c", PATCH_SCRIPT], ctx.workspace, timeout=120, unsafe=ctx.unsafe
    )
    out = ctx.workspace / ".git" / "cadenza_model.patch"
    if res.returncode != 0 or out.is_symlink() or not out.is_file():
        return ""
    try:
        text = out.read_text(encoding="utf-8", errors="replace")
    finally:
        out.unlink(missing_ok=True)
    return text


class _Live:
    """One episode in progress: its record, conversation, workspace and budgets."""

    def __init__(self, ep: Episode, messages: list[dict], ctx: ToolContext):
        self.ep, self.messages, self.ctx = ep, messages, ctx
        self.generated = 0
        self.assistant_turns = 0
        self.done = False

    def append(self, ids: Sequence[int], policy: bool, logprobs: Sequence[float] | None = None):
        self.ep.token_ids += list(ids)
        self.ep.policy_mask += [policy] * len(ids)
        if logprobs is not None and len(logprobs) == len(ids):
            self.ep.behavior_logprobs += [float(x) for x in logprobs]
        else:
            self.ep.behavior_logprobs += [0.0] * len(ids)


class EpisodeRunner:
    """Runs groups of episodes for a policy with one chat format, toolbox and config."""

    def __init__(
        self,
        policy: Any,
        fmt: ChatFormat | None = None,
        config: AgentConfig | None = None,
        toolbox: Toolbox | None = None,
        run_command: Callable[..., Any] | None = None,
        open_tag: str = "<|tool_call|>",
        close_tag: str = "<|/tool_call|>",
    ):
        self.policy, self.fmt = policy, fmt
        self.cfg = config or AgentConfig()
        self.toolbox = toolbox or Toolbox()
        self.run_command = run_command
        self.tokens = bool(getattr(policy, "needs_token_ids", False))
        if self.tokens and fmt is None:
            raise ValueError("a token-level policy (LocalPolicy) needs a chat format")
        self.open_tag = fmt.open_tag if fmt is not None else open_tag
        self.close_tag = fmt.close_tag if fmt is not None else close_tag

    # --- setup ---
    def _context(self, task: AgentTask, ws: Path) -> ToolContext:
        kw = dict(
            workspace=ws,
            test_command=tuple(task.test_command),
            command_timeout=self.cfg.command_timeout,
            test_timeout=self.cfg.test_timeout,
            memory_mb=self.cfg.memory_mb,
            unsafe=self.cfg.unsafe_sandbox,
            max_observation_chars=self.cfg.max_observation_chars,
            env=task.env,
            ro_binds=tuple(task.ro_binds),
        )
        if self.run_command is not None:
            kw["run_command"] = self.run_command
        return ToolContext(**kw)

    def _start(self, task: AgentTask, index: int, workdir: Path) -> _Live:
        ws = workdir / f"{task.instance_id}-{index}"
        if ws.exists():
            shutil.rmtree(ws)
        task.prepare_workspace(ws)
        messages = [
            {"role": "system", "content": self.cfg.system_prompt},
            {"role": "user", "content": user_prompt(task)},
        ]
        live = _Live(Episode(task.instance_id), messages, self._context(task, ws))
        live.ep.info["workspace"] = str(ws)
        if self.tokens:
            ids, spans = self.fmt.prompt_ids(messages, self.toolbox.schemas())
            live.append(ids, False)
            for m, (s, e) in zip(messages, spans):
                live.ep.turns.append(Turn(m["role"], s, e, text=m["content"]))
        else:
            for m in messages:
                live.ep.turns.append(Turn(m["role"], 0, 0, text=m["content"]))
        return live

    # --- one turn ---
    def _budget(self, live: _Live) -> int:
        cfg = self.cfg
        if live.assistant_turns >= cfg.max_turns:
            live.ep.finish_reason = "max_turns"
            return 0
        if live.generated >= cfg.max_episode_tokens:
            live.ep.finish_reason = "max_tokens"
            return 0
        budget = min(cfg.max_new_tokens, cfg.max_episode_tokens - live.generated)
        if self.tokens:
            room = (
                cfg.max_context - len(live.ep.token_ids) - len(self.fmt.generation_prompt_ids()) - 1
            )
            if room < 1:
                live.ep.finish_reason = "context"
                return 0
            budget = min(budget, room)
        return budget

    def _request(self, live: _Live, budget: int) -> PolicyRequest:
        prompt = live.ep.token_ids + self.fmt.generation_prompt_ids() if self.tokens else []
        return PolicyRequest(prompt, live.messages, self.toolbox.schemas(), budget)

    def _record_tokens(self, live: _Live, out: PolicyOutput) -> tuple[int, int]:
        """Append the turn's tokens; return the assistant span."""
        ep = live.ep
        if self.tokens:
            start = len(ep.token_ids)
            live.append(self.fmt.generation_prompt_ids(), False)
            gen = out.token_ids or []
            live.append(gen, True, out.logprobs)
            live.append(self.fmt.close_assistant_ids(gen), False)
            return start, len(ep.token_ids)
        # HTTP: keep the server's tokens when it sends them and they extend what we have.
        if (
            out.token_ids is None
            or out.prompt_ids is None
            or ep.info.get("token_ids") == "unavailable"
        ):
            ep.info["token_ids"] = "unavailable"
            ep.token_ids, ep.policy_mask, ep.behavior_logprobs = [], [], []
            return 0, 0
        n = len(ep.token_ids)
        if list(out.prompt_ids[:n]) != ep.token_ids:
            ep.info["token_ids"] = "unavailable"
            ep.token_ids, ep.policy_mask, ep.behavior_logprobs = [], [], []
            return 0, 0
        # The server's prompt adds the closing of our last reply and the messages since: they
        # are recorded as context (not policy) tokens; those messages' own spans stay empty.
        live.append(out.prompt_ids[n:], False)
        start = len(ep.token_ids)
        if self.fmt is not None:  # the turn's span starts at its generation prompt, as locally
            gp = self.fmt.generation_prompt_ids()
            if gp and ep.token_ids[len(ep.token_ids) - len(gp) :] == gp:
                start -= len(gp)
        live.append(out.token_ids, True, out.logprobs)
        ep.info["token_ids"] = "server"
        return start, len(ep.token_ids)

    def _step(self, live: _Live, out: PolicyOutput) -> None:
        ep = live.ep
        live.assistant_turns += 1
        if out.finish_reason == "error":
            ep.turns.append(
                Turn("assistant", len(ep.token_ids), len(ep.token_ids), error_kinds=[POLICY_ERROR])
            )
            ep.finish_reason, ep.info["error"] = "error", out.error
            live.done = True
            return
        start, end = self._record_tokens(live, out)
        live.generated += (
            len(out.token_ids) if out.token_ids is not None else max(len(out.text) // 4, 1)
        )
        text = out.text
        if self.tokens and out.token_ids:
            text = self.fmt.decode(self.fmt.strip_stop(out.token_ids))
        for call in out.tool_calls:  # structured calls (HTTP) parse like tagged ones
            fn = call.get("function") or {}
            args = fn.get("arguments")
            body = json.dumps(
                {"name": fn.get("name"), "arguments": args if args is not None else {}},
                ensure_ascii=False,
            )
            text += f"{self.open_tag}{body}{self.close_tag}"
        parsed = parse_tool_calls(text, self.open_tag, self.close_tag)
        kinds = parsed.error_kinds
        if out.finish_reason == "length":
            kinds.append(TRUNCATED)
        turn = Turn("assistant", start, end, text=text, tool_calls=parsed.calls, error_kinds=kinds)
        ep.turns.append(turn)
        ok_calls = [c for i, c in enumerate(parsed.calls) if parsed.problem_for(i) is None]
        live.messages.append(
            {
                "role": "assistant",
                "content": parsed.content,
                **(
                    {"token_ids": out.token_ids}
                    if not self.tokens and out.token_ids and ep.info.get("token_ids") == "server"
                    else {}
                ),
                **(
                    {
                        "tool_calls": [
                            {
                                "id": c.id,
                                "type": "function",
                                "function": {
                                    "name": c.name,
                                    "arguments": json.dumps(c.arguments, ensure_ascii=False),
                                },
                            }
                            for c in ok_calls
                        ]
                    }
                    if ok_calls
                    else {}
                ),
            }
        )
        notes = [p.message for p in parsed.problems if p.call_index is None]
        if not parsed.calls:
            empty = not parsed.content.strip()
            turn.error_kinds.append(EMPTY_RESPONSE if empty else NO_TOOL_CALL)
            notes.append(no_call_feedback(self.toolbox.names, empty))
        submitted = False
        for i, call in enumerate(parsed.calls):
            problem = parsed.problem_for(i)
            if problem is not None:
                # Not a call the conversation can carry (no valid id/arguments): say so as a
                # user message, so OpenAI-style servers accept the history.
                notes.append(f"Error in tool call {i + 1}: {problem.message}")
                continue
            res = self.toolbox.call(call.name, call.arguments, live.ctx)
            if res.error_kind and res.error_kind not in turn.error_kinds:
                turn.error_kinds.append(res.error_kind)
            msg = {
                "role": "tool",
                "tool_call_id": call.id,
                "name": call.name,
                "content": res.observation,
            }
            self._add_message(live, msg, tool_name=call.name)
            if res.done:
                submitted = True
                break
        if notes and not submitted:
            self._add_message(live, {"role": "user", "content": "\n".join(notes)})
        if submitted:
            ep.finish_reason = "submit"
            live.done = True

    def _add_message(self, live: _Live, msg: dict, tool_name: str | None = None) -> None:
        ep = live.ep
        start = len(ep.token_ids)
        if self.tokens:
            live.append(self.fmt.message_ids(msg, live.messages), False)
        ep.turns.append(
            Turn(
                msg["role"],
                start,
                len(ep.token_ids),
                text=msg["content"],
                observation=msg["content"],
                tool_name=tool_name,
            )
        )
        live.messages.append(msg)

    # --- a group ---
    def run_group(self, task: AgentTask, n: int, workdir: Path) -> list[Episode]:
        """`n` episodes of `task` (workspaces under `workdir`), graded."""
        return self.run_groups([task], n, [workdir])[0]

    def run_groups(
        self, tasks: Sequence[AgentTask], n: int, workdirs: Sequence[Path]
    ) -> list[list[Episode]]:
        """`n` episodes of each task (task k's workspaces under `workdirs[k]`), graded.

        One `policy.generate` call per turn serves the live episodes of every group (an RL
        step's tasks x G episodes batch together on the local sampler)."""
        if len(workdirs) != len(tasks):
            raise ValueError(f"{len(tasks)} tasks but {len(workdirs)} workdirs; give one each")
        starts = []
        for task, workdir in zip(tasks, workdirs):
            Path(workdir).mkdir(parents=True, exist_ok=True)
            starts += [(task, i, Path(workdir)) for i in range(n)]
        lives = [self._start(*s) for s in starts]
        while True:
            batch = []
            for live in lives:
                if live.done:
                    continue
                budget = self._budget(live)
                if budget <= 0:
                    live.done = True
                    continue
                batch.append((live, self._request(live, budget)))
            if not batch:
                break
            outputs = self.policy.generate([r for _, r in batch])
            if len(outputs) != len(batch):
                raise RuntimeError(
                    f"{type(self.policy).__name__}.generate returned {len(outputs)} outputs "
                    f"for {len(batch)} requests; a policy must answer every request"
                )
            # Episodes are independent: their tools (sandboxed processes) run concurrently.
            self._each(
                lambda pair: self._step(*pair),
                [(live, out) for (live, _), out in zip(batch, outputs)],
            )
        self._each(
            lambda pair: self._grade(*pair), [(s[0], live) for s, live in zip(starts, lives)]
        )
        return [[live.ep for live in lives[k * n : (k + 1) * n]] for k in range(len(tasks))]

    def _each(self, fn: Callable[[Any], None], items: list[Any]) -> None:
        workers = min(self.cfg.tool_workers, len(items))
        if workers <= 1:
            for item in items:
                fn(item)
            return
        with ThreadPoolExecutor(workers) as pool:
            for f in [pool.submit(fn, item) for item in items]:
                f.result()

    def _trim(self, live: _Live) -> None:
        """Drop messages after the last reply that overflow the context: nothing reads them,
        and a recorded sequence then always fits `max_context` (unless the prompt alone does not)."""
        ep, limit = live.ep, self.cfg.max_context
        if not self.tokens or len(ep.token_ids) <= limit:
            return
        last = max(ep.assistant_turns(), default=-1)
        while len(ep.turns) - 1 > last and ep.turns[-1].end > limit and ep.turns[-1].start > 0:
            cut = ep.turns.pop().start
            del ep.token_ids[cut:], ep.policy_mask[cut:], ep.behavior_logprobs[cut:]
            ep.info["trimmed_messages"] = ep.info.get("trimmed_messages", 0) + 1

    def _grade(self, task: AgentTask, live: _Live) -> None:
        self._trim(live)
        ep = live.ep
        patch = workspace_patch(live.ctx)
        ep.info["model_patch"] = patch
        ep.info["num_tool_calls"] = sum(len(t.tool_calls) for t in ep.turns)
        ep.info["error_kinds"] = sorted({k for t in ep.turns for k in t.error_kinds})
        if task.grade is None:
            return
        try:
            g = _as_grade(task.grade(patch))
        except Exception as e:  # a grader failure must not lose the group's episodes
            ep.info["grade_error"] = f"{type(e).__name__}: {e}"
            return
        ep.resolved, ep.reward = g.resolved, g.reward
        ep.info["grade"] = g.details


def run_group(policy: Any, task: AgentTask, n: int, workdir: Path, **kwargs: Any) -> list[Episode]:
    """Functional entry point: `EpisodeRunner(policy, **kwargs).run_group(task, n, workdir)`."""
    return EpisodeRunner(policy, **kwargs).run_group(task, n, workdir)
