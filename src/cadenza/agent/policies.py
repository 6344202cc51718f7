"""Policies: what produces the assistant's next message for a batch of conversations.

- `LocalPolicy`: the in-process cadenza sampler on token ids; one `generate` call for the
  whole batch (the live episodes of a group), so the model runs batched.
- `HTTPPolicy`: any OpenAI-compatible chat-completions endpoint with tools (vLLM, SGLang,
  hosted APIs, `cadenza serve`), on urllib. A generic server returns text and structured
  tool calls only; when it also returns token ids (`cadenza serve` does: `prompt_token_ids`
  on the response, `token_ids` on the choice, logprobs in the standard field) they are kept.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]


@dataclass
class PolicyRequest:
    prompt_ids: list[int]  # the conversation so far, ending with the generation prompt
    messages: list[Message]  # the same conversation as OpenAI chat messages
    tools: list[dict[str, Any]]
    max_new_tokens: int


@dataclass
class PolicyOutput:
    text: str  # everything generated, tool-call markup included
    finish_reason: str  # "stop" | "length" | "error"
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    prompt_ids: list[int] | None = None  # the prompt as the server tokenized it
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # structured (HTTP)
    error: str = ""


class PolicyError(RuntimeError):
    """The policy could not answer (endpoint down, bad response); says what to check."""


class LocalPolicy:
    """The cadenza sampler in this process: `generate(model, prompts, ...)` on token ids."""

    needs_token_ids = True

    def __init__(
        self,
        model: Any,
        fmt: Any,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = 0,
        generate_fn: Callable[..., Any] | None = None,
    ):
        if generate_fn is None:
            from cadenza.model import generate as generate_fn
        self.model, self.fmt = model, fmt
        self.temperature, self.top_p, self.seed = temperature, top_p, seed
        self.generate_fn = generate_fn
        self._calls = 0

    def generate(self, requests: Sequence[PolicyRequest]) -> list[PolicyOutput]:
        out: list[PolicyOutput | None] = [None] * len(requests)
        by_budget: dict[int, list[int]] = {}
        for i, r in enumerate(requests):
            by_budget.setdefault(r.max_new_tokens, []).append(i)
        for budget, idx in sorted(by_budget.items()):  # one call unless budgets differ
            seed = None if self.seed is None else self.seed + self._calls
            self._calls += 1
            gens = self.generate_fn(
                self.model,
                [requests[i].prompt_ids for i in idx],
                max_new_tokens=budget,
                temperature=self.temperature,
                top_p=self.top_p,
                stop_tokens=tuple(self.fmt.stop_token_ids),
                seed=seed,
            )
            for i, g in zip(idx, gens):
                tokens = [int(t) for t in g.tokens]
                lps = [float(x) for x in g.logprobs]
                finish = "stop" if tokens and tokens[-1] in self.fmt.stop_token_ids else "length"
                out[i] = PolicyOutput(self.fmt.decode(tokens), finish, tokens, lps)
        return out  # type: ignore[return-value]


class HTTPPolicy:
    """An OpenAI-compatible `/v1/chat/completions` endpoint; requests of a batch in parallel."""

    needs_token_ids = False

    def __init__(
        self,
        endpoint: str,
        model: str,
        temperature: float = 1.0,
        top_p: float = 1.0,
        api_key: str | None = None,
        timeout: float = 600.0,
        stream: bool = False,
        logprobs: bool = False,
        max_parallel: int = 8,
        extra_body: dict[str, Any] | None = None,
    ):
        base = endpoint.rstrip("/")
        if not base.startswith(("http://", "https://")):
            raise PolicyError(
                f"endpoint {endpoint!r}: expected an http(s) URL, e.g. http://127.0.0.1:8000/v1"
            )
        if not base.endswith("/chat/completions"):
            base = base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")
        self.url, self.model = base, model
        self.temperature, self.top_p, self.api_key = temperature, top_p, api_key
        self.timeout, self.stream, self.logprobs = timeout, stream, logprobs
        self.max_parallel, self.extra_body = max_parallel, extra_body or {}

    def _post(self, body: dict[str, Any]) -> Any:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url, json.dumps(body).encode(), headers, method="POST")
        try:
            return urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            raise PolicyError(f"{self.url} answered HTTP {e.code}: {detail}") from e
        except (urllib.error.URLError, OSError) as e:
            raise PolicyError(f"cannot reach {self.url}: {e}; is the server running?") from e

    def body(self, r: PolicyRequest) -> dict[str, Any]:
        body = {
            "model": self.model,
            "messages": r.messages,
            "max_tokens": r.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            **self.extra_body,
        }
        if r.tools:
            body["tools"] = r.tools
        if self.logprobs:
            body["logprobs"] = True
        return body

    def complete(self, r: PolicyRequest) -> PolicyOutput:
        try:
            with self._post(self.body(r)) as resp:
                if self.stream:
                    return _from_stream(resp)
                data = json.loads(resp.read())
            return _from_response(data)
        except PolicyError as e:
            return PolicyOutput("", "error", error=str(e))
        except (ValueError, KeyError, IndexError, TypeError) as e:
            return PolicyOutput("", "error", error=f"unexpected response from {self.url}: {e!r}")

    def generate(self, requests: Sequence[PolicyRequest]) -> list[PolicyOutput]:
        if len(requests) <= 1:
            return [self.complete(r) for r in requests]
        with ThreadPoolExecutor(min(self.max_parallel, len(requests))) as pool:
            return list(pool.map(self.complete, requests))


def _finish(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def _logprobs(choice: dict[str, Any]) -> list[float] | None:
    lp = choice.get("logprobs")
    if isinstance(lp, dict) and isinstance(lp.get("content"), list):
        return [float(x.get("logprob", 0.0)) for x in lp["content"]]
    return None


def _from_response(data: dict[str, Any]) -> PolicyOutput:
    choice = data["choices"][0]
    msg = choice.get("message") or {}
    token_ids = choice.get("token_ids")
    return PolicyOutput(
        text=msg.get("content") or "",
        finish_reason=_finish(choice.get("finish_reason")),
        token_ids=list(token_ids) if token_ids is not None else None,
        logprobs=_logprobs(choice),
        prompt_ids=data.get("prompt_token_ids"),
        tool_calls=list(msg.get("tool_calls") or []),
    )


def _from_stream(resp: Any) -> PolicyOutput:
    """Assemble server-sent chat.completion.chunk events into one output."""
    text: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    finish, token_ids, prompt_ids, lps = None, [], None, []
    for raw in resp:
        line = raw.decode("utf-8", errors="replace").strip()
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            break
        chunk = json.loads(payload)
        prompt_ids = chunk.get("prompt_token_ids", prompt_ids)
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            text.append(delta.get("content") or "")
            for tc in delta.get("tool_calls") or []:
                c = calls.setdefault(
                    tc.get("index", 0),
                    {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
                )
                c["id"] = tc.get("id") or c["id"]
                fn = tc.get("function") or {}
                c["function"]["name"] += fn.get("name") or ""
                c["function"]["arguments"] += fn.get("arguments") or ""
            token_ids += choice.get("token_ids") or []
            lps += _logprobs(choice) or []
            finish = choice.get("finish_reason") or finish
    return PolicyOutput(
        text="".join(text),
        finish_reason=_finish(finish),
        token_ids=token_ids or None,
        logprobs=lps or None,
        prompt_ids=prompt_ids,
        tool_calls=[calls[k] for k in sorted(calls)],
    )
