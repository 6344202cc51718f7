"""Messages <-> token ids through a chat template, and tool calls parsed from generations.

Two formats share one interface (`ChatFormat`):

- `CadenzaFormat`, the tiny model's template over cadenza's tokenizer specials: each message
  is `<|im_start|>ROLE\nCONTENT<|im_end|>`; an assistant's tool calls follow its text as
  `<|tool_call|>{"name": N, "arguments": A}<|/tool_call|>`; a tool's output is wrapped in
  `<|tool_result|>...<|/tool_result|>`; tool definitions go in the system message.
  Scaffolding tokens are the special ids; message text is encoded as plain text, so a
  literal "<|im_end|>" typed in a file cannot end a message.
- `JinjaFormat`, a checkpoint's own `chat_template` (tokenizer_config.json), rendered with
  jinja2 in a sandbox as transformers does; message tokens are the difference between
  renderings with and without the message; calls use `<tool_call>` tags (Hermes/Qwen).

Episodes are built by appending, never by re-rendering: the prompt's messages, then per
assistant turn the generation prompt, the sampled ids exactly as sampled, the template's
closing of the message, and the next messages. So an assistant turn's span is
[generation prompt start, end of closing) and `policy_mask` covers the sampled ids only.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cadenza.agent.episode import Episode
from cadenza.agent.tool_call_parse import ParsedOutput, parse_tool_calls

Message = dict[str, Any]


class ChatFormatError(ValueError):
    """A template or tokenizer that cannot be used; the message says why and what to do."""


def backend_tokenizer(tok: Any) -> Any:
    """The `tokenizers.Tokenizer` inside a tokenizer object, a tokenizer.json path, or `tok`."""
    from tokenizers import Tokenizer

    if isinstance(tok, (str, Path)):
        p = Path(tok)
        p = p / "tokenizer.json" if p.is_dir() else p
        if not p.is_file():
            raise ChatFormatError(f"no tokenizer.json at {p}; expected a tokenizers JSON file")
        return Tokenizer.from_file(str(p))
    for attr in ("hf", "backend_tokenizer", "tokenizer", "_tokenizer"):
        inner = getattr(tok, attr, None)
        if isinstance(inner, Tokenizer):
            return inner
    if isinstance(tok, Tokenizer):
        return tok
    raise ChatFormatError(
        f"cannot use {type(tok).__name__} as a tokenizer; expected a tokenizers.Tokenizer, "
        "a wrapper holding one, or a path to tokenizer.json"
    )


def _tool_call_json(call: dict[str, Any]) -> str:
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    return json.dumps({"name": fn.get("name", ""), "arguments": args}, ensure_ascii=False)


class ChatFormat(abc.ABC):
    """What the harness and the server need from a template (see module docstring)."""

    name = "base"
    open_tag = "<|tool_call|>"
    close_tag = "<|/tool_call|>"

    def __init__(self, tokenizer: Any):
        from tokenizers import Tokenizer

        tok = backend_tokenizer(tokenizer)
        # Two copies: `_plain` encodes message text with special-token strings as plain text,
        # `_tok` recognizes them (for rendered templates); neither mutates the caller's object.
        self._tok = Tokenizer.from_str(tok.to_str())
        self._plain = Tokenizer.from_str(tok.to_str())
        self._plain.encode_special_tokens = True

    # --- plain text ---
    def encode_text(self, text: str) -> list[int]:
        return self._plain.encode(text, add_special_tokens=False).ids if text else []

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    # --- to be provided by a template ---
    stop_token_ids: list[int] = []

    @abc.abstractmethod
    def prompt_ids(
        self, messages: Sequence[Message], tools: Sequence[dict] | None = None
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of the opening messages and each one's [start, end) span."""
        raise NotImplementedError

    @abc.abstractmethod
    def generation_prompt_ids(self) -> list[int]:
        raise NotImplementedError

    @abc.abstractmethod
    def close_assistant_ids(self, generated: Sequence[int]) -> list[int]:
        """Ids that end an assistant message after `generated` (empty when it ended itself)."""
        raise NotImplementedError

    @abc.abstractmethod
    def message_ids(self, message: Message, history: Sequence[Message] = ()) -> list[int]:
        """Ids of one whole non-assistant message appended after `history`."""
        raise NotImplementedError

    @abc.abstractmethod
    def assistant_body_ids(self, message: Message) -> list[int]:
        """Ids an assistant message would have been sampled as (content, calls, stop)."""
        raise NotImplementedError

    # --- shared ---
    def parse(self, generated: Sequence[int] | str) -> ParsedOutput:
        text = generated if isinstance(generated, str) else self.decode(self.strip_stop(generated))
        return parse_tool_calls(text, self.open_tag, self.close_tag)

    def strip_stop(self, ids: Sequence[int]) -> list[int]:
        ids = list(ids)
        return ids[:-1] if ids and ids[-1] in self.stop_token_ids else ids

    def encode_conversation(
        self,
        messages: Sequence[Message],
        tools: Sequence[dict] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """A whole conversation as the runner would have built it turn by turn.

        Assistant messages carrying `token_ids` (the ids they were sampled as, an extension
        `cadenza serve` returns) are used verbatim, so a client that sends them back gets
        exactly the prompt a local episode would have.
        """
        n_open = 0
        while n_open < len(messages) and messages[n_open].get("role") in ("system", "user"):
            n_open += 1
        ids, _ = self.prompt_ids(messages[:n_open], tools)
        for i in range(n_open, len(messages)):
            m = messages[i]
            if m.get("role") == "assistant":
                body = m.get("token_ids")
                body = list(body) if body else self.assistant_body_ids(m)
                ids += self.generation_prompt_ids() + body + self.close_assistant_ids(body)
            else:
                ids += self.message_ids(m, messages[:i])
        if add_generation_prompt:
            ids += self.generation_prompt_ids()
        return ids


@dataclass(frozen=True)
class CadenzaTokens:
    """The chat special tokens of cadenza's tokenizer (cadenza.model.tokenizer)."""

    im_start: str = "<|im_start|>"
    im_end: str = "<|im_end|>"
    tool_call: str = "<|tool_call|>"
    tool_call_end: str = "<|/tool_call|>"
    tool_result: str = "<|tool_result|>"
    tool_result_end: str = "<|/tool_result|>"
    bos: str = "<|bos|>"  # optional: starts the conversation when the tokenizer has it
    eos: str = "<|eos|>"  # optional: also stops generation when the tokenizer has it


_ROLES = ("system", "user", "assistant", "tool")


class CadenzaFormat(ChatFormat):
    """`<|im_start|>ROLE\nCONTENT<|im_end|>` per message (ChatML with special-token tool
    markup); a tool message wraps its output in `<|tool_result|>...<|/tool_result|>`."""

    name = "cadenza"

    def __init__(self, tokenizer: Any, tokens: CadenzaTokens = CadenzaTokens()):
        super().__init__(tokenizer)
        self.tokens = tokens
        self.open_tag, self.close_tag = tokens.tool_call, tokens.tool_call_end
        required = (
            "im_start",
            "im_end",
            "tool_call",
            "tool_call_end",
            "tool_result",
            "tool_result_end",
        )
        missing = [
            getattr(tokens, k)
            for k in required
            if self._tok.token_to_id(getattr(tokens, k)) is None
        ]
        if missing:
            raise ChatFormatError(
                f"tokenizer lacks the cadenza chat special tokens {missing}; use a tokenizer "
                "trained by `cadenza tokenizer train`, or the checkpoint's own chat_template"
            )
        self._id = {k: self._tok.token_to_id(v) for k, v in vars(tokens).items()}
        self.stop_token_ids = [self._id["im_end"]] + (
            [self._id["eos"]] if self._id["eos"] is not None else []
        )
        self._headers = {r: [self._id["im_start"]] + self.encode_text(f"{r}\n") for r in _ROLES}

    def _header(self, role: str) -> list[int]:
        if role not in self._headers:
            raise ChatFormatError(f"unknown message role {role!r}; expected one of {list(_ROLES)}")
        return self._headers[role]

    def tools_block(self, tools: Sequence[dict]) -> list[int]:
        ids = self.encode_text("# Tools\nCall a tool by writing ")
        ids += [self._id["tool_call"]]
        ids += self.encode_text('{"name": NAME, "arguments": {...}}')
        ids += [self._id["tool_call_end"]]
        ids += self.encode_text(". Available tools:\n")
        for t in tools:
            fn = t.get("function", t)
            ids += self.encode_text(json.dumps(fn, ensure_ascii=False) + "\n")
        return ids

    def prompt_ids(self, messages, tools=None):
        messages = list(messages)
        if tools and not (messages and messages[0].get("role") == "system"):
            messages.insert(0, {"role": "system", "content": ""})
        ids: list[int] = [self._id["bos"]] if self._id["bos"] is not None else []
        spans = []
        for i, m in enumerate(messages):
            start = 0 if i == 0 else len(ids)
            if i == 0 and m.get("role") == "system" and tools:
                content = str(m.get("content") or "")
                ids += self._header("system") + self.encode_text(
                    content + ("\n\n" if content else "")
                )
                ids += self.tools_block(tools) + [self._id["im_end"]]
            else:
                ids += self.message_ids(m)
            spans.append((start, len(ids)))
        return ids, spans

    def generation_prompt_ids(self):
        return list(self._headers["assistant"])

    def close_assistant_ids(self, generated):
        return [] if generated and generated[-1] == self._id["im_end"] else [self._id["im_end"]]

    def message_ids(self, message, history=()):
        role = message.get("role", "")
        if role == "assistant":
            body = self.assistant_body_ids(message)
            return self.generation_prompt_ids() + body + self.close_assistant_ids(body)
        text = self.encode_text(str(message.get("content") or ""))
        if role == "tool":
            text = [self._id["tool_result"]] + text + [self._id["tool_result_end"]]
        return self._header(role) + text + [self._id["im_end"]]

    def assistant_body_ids(self, message):
        ids = self.encode_text(str(message.get("content") or ""))
        for call in message.get("tool_calls") or []:
            ids += [self._id["tool_call"]]
            ids += self.encode_text(_tool_call_json(call))
            ids += [self._id["tool_call_end"]]
        return ids + [self._id["im_end"]]


def _render_env():
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # a transformers dependency; not one of cadenza's core ones
        raise ChatFormatError(
            "this checkpoint ships a chat_template, which needs jinja2: pip install jinja2 "
            "(it comes with transformers)"
        ) from e

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
        return json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


class JinjaFormat(ChatFormat):
    """A checkpoint's own chat template (Hugging Face `chat_template`, jinja2)."""

    name = "jinja"
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
    _SENTINEL = "\u2063CADENZA\u2063"

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str,
        special: dict[str, str] | None = None,
        stop_tokens: Sequence[str] = (),
    ):
        super().__init__(tokenizer)
        self.special = {k: v for k, v in (special or {}).items() if isinstance(v, str)}
        try:
            self.template = _render_env().from_string(chat_template)
        except Exception as e:  # jinja2.TemplateSyntaxError and friends
            raise ChatFormatError(f"chat_template does not compile: {e}") from e
        stops = list(stop_tokens) or [self.special.get("eos_token", "")]
        self.stop_token_ids = [
            i for i in (self._tok.token_to_id(s) for s in stops if s) if i is not None
        ]
        if not self.stop_token_ids:
            raise ChatFormatError(
                f"no stop token among {stops} in the tokenizer; give stop_tokens or eos_token"
            )
        # What the template puts after an assistant message's content (e.g. "<|im_end|>\n").
        probe = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": self._SENTINEL},
        ]
        text = self.render(probe, add_generation_prompt=False)
        self._after_assistant = text[text.rindex(self._SENTINEL) + len(self._SENTINEL) :]
        user_only = self.render(probe[:1], add_generation_prompt=False)
        self._gen_prompt = self.render(probe[:1], add_generation_prompt=True)[len(user_only) :]

    def render(self, messages, tools=None, add_generation_prompt=True) -> str:
        try:
            return self.template.render(
                messages=list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                **self.special,
            )
        except Exception as e:
            raise ChatFormatError(f"chat_template failed to render: {e}") from e

    def _encode_rendered(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids if text else []

    def _delta(self, before: Sequence[Message], after: Sequence[Message], tools=None) -> str:
        a = self.render(before, tools, add_generation_prompt=False) if before else ""
        b = self.render(after, tools, add_generation_prompt=False)
        if not b.startswith(a):
            raise ChatFormatError(
                "chat_template renders earlier messages differently once a message is added; "
                "cadenza needs an append-only template (use the cadenza format instead)"
            )
        return b[len(a) :]

    def prompt_ids(self, messages, tools=None):
        ids: list[int] = []
        spans = []
        for i in range(len(messages)):
            start = len(ids)
            ids += self._encode_rendered(self._delta(messages[:i], messages[: i + 1], tools))
            spans.append((start, len(ids)))
        return ids, spans

    def generation_prompt_ids(self):
        return self._encode_rendered(self._gen_prompt)

    def close_assistant_ids(self, generated):
        if generated and generated[-1] in self.stop_token_ids:
            stop_text = self.decode(generated[-1:])
            rest = self._after_assistant
            rest = rest[len(stop_text) :] if rest.startswith(stop_text) else rest
            return self._encode_rendered(rest)
        return self._encode_rendered(self._after_assistant)

    def message_ids(self, message, history=()):
        history = list(history) or [{"role": "user", "content": "hi"}]
        return self._encode_rendered(self._delta(history, history + [message]))

    def assistant_body_ids(self, message):
        text = str(message.get("content") or "")
        for call in message.get("tool_calls") or []:
            text += f"{self.open_tag}\n{_tool_call_json(call)}\n{self.close_tag}"
        return self._encode_rendered(text) + self.stop_token_ids[:1]


def load_chat_format(path: str | Path, tokenizer: Any = None) -> ChatFormat:
    """The chat format of a checkpoint directory: its own chat_template when
    tokenizer_config.json ships one, else the cadenza template."""
    p = Path(path)
    tok = tokenizer if tokenizer is not None else p
    cfg_path = p / "tokenizer_config.json"
    if cfg_path.is_file():
        try:
            cfg = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise ChatFormatError(f"{cfg_path} is not valid JSON: {e}") from e
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if isinstance(template, str) and template.strip():
            special = {
                k: v if isinstance(v, str) else (v or {}).get("content")
                for k, v in cfg.items()
                if k.endswith("_token")
            }
            return JinjaFormat(tok, template, special)
    return CadenzaFormat(tok)


def insert_message_before(
    episode: Episode, turn_index: int, role: str, text: str, fmt: ChatFormat
) -> tuple[list[int], list[int]]:
    """The teacher sequence: `episode.token_ids` with a message inserted at the boundary
    before assistant turn `turn_index`, and `position_map[i]` = the new index of old token i.

    The student's tokens are unchanged and keep their order; every token at or after the
    turn's start moves right by the inserted message's length.
    """
    if not 0 <= turn_index < len(episode.turns):
        raise IndexError(
            f"turn_index {turn_index} out of range; episode {episode.task_id} has "
            f"{len(episode.turns)} turns"
        )
    turn = episode.turns[turn_index]
    if turn.role != "assistant":
        raise ValueError(
            f"turn {turn_index} of episode {episode.task_id} is a {turn.role} turn; hints go "
            f"before assistant turns: {episode.assistant_turns()}"
        )
    history = [{"role": t.role, "content": t.text} for t in episode.turns[:turn_index]]
    inserted = fmt.message_ids({"role": role, "content": text}, history)
    s = turn.start
    ids = episode.token_ids[:s] + inserted + episode.token_ids[s:]
    n = len(inserted)
    position_map = list(range(s)) + list(range(s + n, len(episode.token_ids) + n))
    return ids, position_map
