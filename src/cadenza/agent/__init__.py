"""cadenza.agent: tools, chat/tool-call format, episode runner, policies (local, HTTP), serve.

    fmt = load_chat_format(ckpt_dir)
    runner = EpisodeRunner(LocalPolicy(model, fmt), fmt, AgentConfig())
    episodes = runner.run_group(task, n=8, workdir=path)   # graded Episode records

Every per-turn error kind the harness records is in `ERROR_KINDS`.
"""

from cadenza.agent import tool_call_parse as _parse
from cadenza.agent import tools as _tools
from cadenza.agent.chat_format import (
    CadenzaFormat,
    ChatFormat,
    ChatFormatError,
    JinjaFormat,
    insert_message_before,
    load_chat_format,
)
from cadenza.agent.episode import Episode, ToolCall, Turn
from cadenza.agent.policies import HTTPPolicy, LocalPolicy, PolicyOutput, PolicyRequest
from cadenza.agent.runner import (
    EMPTY_RESPONSE,
    NO_TOOL_CALL,
    POLICY_ERROR,
    TRUNCATED,
    AgentTask,
    EpisodeRunner,
    GradeResult,
    run_group,
)
from cadenza.agent.tools import TOOLS, Toolbox, ToolContext

ERROR_KINDS: tuple[str, ...] = (
    _tools.UNKNOWN_TOOL,
    _tools.INVALID_ARGUMENTS,
    _tools.PATH_OUTSIDE_WORKSPACE,
    _tools.TOOL_FAILED,
    _parse.MALFORMED_JSON,
    _parse.MALFORMED_CALL,
    _parse.UNCLOSED_CALL,
    _parse.OVERSIZED_CALL,
    _parse.TOO_MANY_CALLS,
    _parse.INVALID_UTF8,
    NO_TOOL_CALL,
    EMPTY_RESPONSE,
    TRUNCATED,
    POLICY_ERROR,
)

__all__ = [
    "ERROR_KINDS",
    "TOOLS",
    "AgentTask",
    "CadenzaFormat",
    "ChatFormat",
    "ChatFormatError",
    "Episode",
    "EpisodeRunner",
    "GradeResult",
    "HTTPPolicy",
    "JinjaFormat",
    "LocalPolicy",
    "PolicyOutput",
    "PolicyRequest",
    "ToolCall",
    "ToolContext",
    "Toolbox",
    "Turn",
    "insert_message_before",
    "load_chat_format",
    "run_group",
]
