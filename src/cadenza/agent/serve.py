"""`cadenza serve`: an OpenAI-compatible chat-completions server for a cadenza checkpoint.

Endpoints: POST /v1/chat/completions (non-streaming, and streaming as server-sent events),
GET /v1/models, GET /health. Tool calls the model writes in its chat format come back as
`tool_calls` (finish_reason "tool_calls"); a reply whose markup does not parse is returned
as plain content, untouched, so the client's harness sees the mistake. Extensions for RL
clients: `prompt_token_ids` on the response and `token_ids` on the choice; an assistant
message sent back with `token_ids` is used verbatim, so the server's prompt is exactly the
sequence the client recorded. Generation is serialized (one model, one lock); streaming
sends the reply in chunks once it is generated.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from cadenza.agent.chat_format import ChatFormat, ChatFormatError


class RequestError(ValueError):
    """A request the server refuses; `status` is the HTTP code."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


@dataclass
class _Request:
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stream: bool
    logprobs: bool


def _number(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise RequestError(f"{key}: expected a number in [{lo}, {hi}], found {v!r}", param=key)
    return float(v)


class ChatService:
    """The server's functional core: request dict -> response dict (or chunk dicts)."""

    def __init__(
        self,
        model: Any,
        fmt: ChatFormat,
        model_name: str,
        *,
        max_new_tokens: int = 512,
        max_context: int | None = None,
        generate_fn: Callable[..., Any] | None = None,
    ):
        if generate_fn is None:
            from cadenza.model import generate as generate_fn
        self.model, self.fmt, self.model_name = model, fmt, model_name
        self.max_new_tokens = max_new_tokens
        cfg = getattr(model, "cfg", None)
        self.max_context = max_context or getattr(cfg, "max_position_embeddings", 1 << 30)
        self.generate_fn = generate_fn
        self._lock = threading.Lock()
        self.created = int(time.time())

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "cadenza",
                }
            ],
        }

    def parse_request(self, body: Any) -> _Request:
        if not isinstance(body, dict):
            raise RequestError("expected a JSON object with messages")
        model = body.get("model")
        if model not in (None, "", self.model_name):
            raise RequestError(
                f"model {model!r} not found; this server serves {self.model_name!r}", 404, "model"
            )
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages: expected a non-empty list of messages", param="messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in (
                "system",
                "user",
                "assistant",
                "tool",
            ):
                raise RequestError(
                    f"messages[{i}]: expected an object with role system, user, assistant or tool",
                    param="messages",
                )
            content = m.get("content")
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                m["content"] = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            elif content is not None and not isinstance(content, str):
                raise RequestError(f"messages[{i}].content: expected a string", param="messages")
        tools = body.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            raise RequestError("tools: expected a list of function definitions", param="tools")
        if body.get("n", 1) != 1:
            raise RequestError("n: only n=1 is supported", param="n")
        try:
            prompt = self.fmt.encode_conversation(messages, tools)
        except ChatFormatError as e:
            raise RequestError(str(e), param="messages") from e
        if any(not isinstance(t, int) or not 0 <= t < self.fmt.vocab_size for t in prompt):
            raise RequestError("messages: token_ids outside the vocabulary", param="messages")
        room = self.max_context - len(prompt)
        if room < 1:
            raise RequestError(
                f"the prompt is {len(prompt)} tokens; this model's context is {self.max_context}",
                param="messages",
            )
        mx = body.get("max_completion_tokens", body.get("max_tokens"))
        mx = self.max_new_tokens if mx is None else mx
        if isinstance(mx, bool) or not isinstance(mx, int) or mx < 1:
            raise RequestError(
                f"max_tokens: expected a positive integer, found {mx!r}", param="max_tokens"
            )
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise RequestError(f"seed: expected an integer, found {seed!r}", param="seed")
        return _Request(
            prompt,
            min(mx, room),
            _number(body, "temperature", 1.0, 0.0, 2.0),
            _number(body, "top_p", 1.0, 1e-9, 1.0),
            seed,
            bool(body.get("stream", False)),
            bool(body.get("logprobs", False)),
        )

    def _generate(self, req: _Request) -> Any:
        with self._lock:
            (g,) = self.generate_fn(
                self.model,
                [req.prompt_ids],
                max_new_tokens=req.max_new_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                stop_tokens=tuple(self.fmt.stop_token_ids),
                seed=req.seed,
            )
        return g

    def _message(self, tokens: list[int]) -> tuple[dict[str, Any], bool]:
        parsed = self.fmt.parse(tokens)
        ok = parsed.calls and not parsed.problems
        if not ok:  # no calls, or markup that does not parse: the raw text, for the client
            return {
                "role": "assistant",
                "content": self.fmt.decode(self.fmt.strip_stop(tokens)),
            }, False
        calls = [
            {
                "id": f"call_{uuid.uuid4().hex[:12]}",
                "type": "function",
                "function": {
                    "name": c.name,
                    "arguments": json.dumps(c.arguments, ensure_ascii=False),
                },
            }
            for c in parsed.calls
        ]
        return {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}, True

    def _logprobs(self, tokens: list[int], lps: list[float]) -> dict[str, Any]:
        content = []
        for t, lp in zip(tokens, lps):
            s = self.fmt.decode([t])
            content.append(
                {
                    "token": s,
                    "logprob": lp,
                    "bytes": list(s.encode("utf-8", "replace")),
                    "top_logprobs": [],
                }
            )
        return {"content": content}

    def complete(self, body: Any) -> dict[str, Any]:
        req = self.parse_request(body)
        g = self._generate(req)
        tokens = [int(t) for t in g.tokens]
        message, has_calls = self._message(tokens)
        finish = "tool_calls" if has_calls else ("stop" if g.finish_reason == "stop" else "length")
        choice = {"index": 0, "message": message, "finish_reason": finish, "token_ids": tokens}
        choice["logprobs"] = self._logprobs(tokens, list(g.logprobs)) if req.logprobs else None
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(req.prompt_ids),
                "completion_tokens": len(tokens),
                "total_tokens": len(req.prompt_ids) + len(tokens),
            },
            "prompt_token_ids": req.prompt_ids,
        }

    def stream(self, body: Any) -> Iterator[dict[str, Any]]:
        """chat.completion.chunk events; the request is validated before the first one."""
        full = self.complete({**body, "stream": False})
        choice = full["choices"][0]
        msg = choice["message"]
        base = {
            "id": full["id"],
            "object": "chat.completion.chunk",
            "created": full["created"],
            "model": self.model_name,
        }

        def chunk(delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
            return {
                **base,
                "choices": [{"index": 0, "delta": delta, "finish_reason": None, **extra}],
            }

        first = chunk({"role": "assistant", "content": ""})
        first["prompt_token_ids"] = full["prompt_token_ids"]
        yield first
        text = msg.get("content") or ""
        for i in range(0, len(text), 32):
            yield chunk({"content": text[i : i + 32]})
        for i, c in enumerate(msg.get("tool_calls") or []):
            fn = c["function"]
            yield chunk(
                {
                    "tool_calls": [
                        {
                            "index": i,
                            "id": c["id"],
                            "type": "function",
                            "function": {"name": fn["name"], "arguments": ""},
                        }
                    ]
                }
            )
            args = fn["arguments"]
            for j in range(0, len(args), 64):
                yield chunk(
                    {"tool_calls": [{"index": i, "function": {"arguments": args[j : j + 64]}}]}
                )
        last = chunk({}, token_ids=choice["token_ids"], logprobs=choice["logprobs"])
        last["choices"][0]["finish_reason"] = choice["finish_reason"]
        last["usage"] = full["usage"]
        yield last


class _Handler(BaseHTTPRequestHandler):
    service: ChatService  # set on the subclass made by make_server
    max_body = 64 << 20
    quiet = True

    def log_message(self, format: str, *args: Any) -> None:
        if not self.quiet:
            super().log_message(format, *args)

    def _json(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, param: str | None = None) -> None:
        kind = "invalid_request_error" if status < 500 else "server_error"
        self._json(
            status, {"error": {"message": message, "type": kind, "param": param, "code": status}}
        )

    def do_GET(self) -> None:
        path = self.path.split("?")[0].rstrip("/")
        if path == "/v1/models":
            self._json(200, self.service.models())
        elif path == "/health":
            self._json(200, {"status": "ok"})
        else:
            self._error(
                404, f"no route GET {self.path}; try /v1/models or POST /v1/chat/completions"
            )

    def do_POST(self) -> None:
        path = self.path.split("?")[0].rstrip("/")
        if path != "/v1/chat/completions":
            self._error(404, f"no route POST {self.path}; expected /v1/chat/completions")
            return
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            n = -1
        if not 0 < n <= self.max_body:
            self._error(
                400 if n <= 0 else 413,
                f"expected a JSON body of 1..{self.max_body} bytes (Content-Length {n})",
            )
            return
        try:
            body = json.loads(self.rfile.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            self._error(400, f"body is not valid JSON: {e}")
            return
        try:
            if isinstance(body, dict) and body.get("stream"):
                events = self.service.stream(body)
                first = next(events)  # validation errors surface before the 200
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()
                for ev in (first, *events):
                    self.wfile.write(f"data: {json.dumps(ev)}\n\n".encode())
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
            else:
                self._json(200, self.service.complete(body))
        except RequestError as e:
            self._error(e.status, str(e), e.param)
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as e:  # a bug or a model failure: report it, keep serving
            self._error(500, f"{type(e).__name__}: {e}")


def make_server(
    service: ChatService, host: str = "127.0.0.1", port: int = 0
) -> ThreadingHTTPServer:
    """A ThreadingHTTPServer bound to host:port (port 0: any free port; see server_address)."""
    handler = type("Handler", (_Handler,), {"service": service})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def load_service(ckpt: str | Path, model_name: str | None = None, **kwargs: Any) -> ChatService:
    """A ChatService for a checkpoint directory (config.json, safetensors, tokenizer.json)."""
    from cadenza.agent.chat_format import load_chat_format
    from cadenza.model import from_pretrained

    p = Path(ckpt)
    model = from_pretrained(p)
    model.eval()
    fmt = load_chat_format(p)
    return ChatService(model, fmt, model_name or p.resolve().name, **kwargs)
