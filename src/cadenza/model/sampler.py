"""Batched sampling with the KV cache, and scoring continuations of a cached prefix.

`generate` left-pads the prompts, prefills them in one forward, then decodes one token per
sequence per step. For each sampled token it returns two log-probabilities:

- `logprobs`: log p(token | context) under the model itself, i.e. log_softmax of the raw
  logits (temperature 1, no top-p). This is what RL needs as the behaviour policy's
  log-probability, and what a full forward's log_softmax gives.
- `sampling_logprobs`: log q(token | context) under the distribution actually sampled from,
  q = softmax(logits / temperature) restricted to the top-p nucleus and renormalized
  (0.0 for greedy decoding, temperature 0).

`prefill` + `score` are the incremental API: prefill a shared prefix once, then score given
continuations on top of its cache (e.g. a teacher with a hint scoring the student's tokens).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from cadenza.model.kv_cache import KVCache


@dataclass
class Generation:
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop token was sampled; it is the last token) | "length"
    sampling_logprobs: list[float] = field(default_factory=list)


@dataclass
class Prefix:
    """A prefilled batch of prefixes: their cache and the logits after their last token."""

    cache: KVCache
    last_logits: torch.Tensor  # [B, V]

    def repeat(self, n: int) -> Prefix:
        """Each prefix n times (row b -> rows b*n .. b*n+n-1), sharing the prefill work."""
        return Prefix(self.cache.repeat(n), self.last_logits.repeat_interleave(n, 0))


@dataclass
class Scores:
    logits: torch.Tensor  # [B, T, V]: logits[b, i] predicts continuation token i
    logprobs: torch.Tensor  # [B, T]: log_softmax(logits) at the token, 0 past each length
    lengths: list[int]


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Generation must not count router load or take training-only branches."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _check_tokens(seqs: list[list[int]], vocab: int, what: str, allow_empty: bool) -> None:
    if not seqs:
        raise ValueError(f"expected a non-empty list of {what}s, found []")
    for i, s in enumerate(seqs):
        if not s and not allow_empty:
            raise ValueError(f"{what} {i} is empty; every {what} needs at least one token")
        bad = [t for t in s if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"{what} {i} has token ids outside [0, {vocab}): {bad[:5]}; check the tokenizer"
            )


def _pad(seqs: list[list[int]], left: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    valid = torch.zeros(len(seqs), T, dtype=torch.bool)
    for b, s in enumerate(seqs):
        sl = slice(T - len(s), T) if left else slice(0, len(s))
        ids[b, sl] = torch.tensor(s, dtype=torch.long)
        valid[b, sl] = True
    return ids.to(device), valid.to(device)


def prefill(
    model: torch.nn.Module, prompts: list[list[int]], capacity: int | None = None
) -> Prefix:
    """Run the (left-padded) prompts through the model into a fresh cache."""
    _check_tokens(prompts, model.cfg.vocab_size, "prompt", allow_empty=False)
    device = model.embed.weight.device
    ids, valid = _pad(prompts, left=True, device=device)
    cache = KVCache.for_model(model, len(prompts), max(capacity or 0, ids.shape[1]))
    hidden = model.hidden(ids, cache=cache, valid=None if bool(valid.all()) else valid)
    return Prefix(cache, model.logits(hidden[:, -1]))


def score(
    model: torch.nn.Module, prefix: Prefix, continuations: list[list[int]], keep: bool = False
) -> Scores:
    """Logits and log-probabilities of given continuation tokens after each prefix.

    Continuations are right-padded. With keep=False the cache is rolled back to the prefix,
    so the same prefix can score other continuations; with keep=True it is extended."""
    B = prefix.cache.batch
    if len(continuations) != B:
        raise ValueError(f"prefix batch has {B} rows but {len(continuations)} continuations")
    _check_tokens(continuations, model.cfg.vocab_size, "continuation", allow_empty=True)
    if max(len(c) for c in continuations) == 0:
        empty = prefix.last_logits.new_zeros(B, 0, prefix.last_logits.shape[-1])
        return Scores(empty, empty[..., 0], [0] * B)
    ids, valid = _pad(continuations, left=False, device=prefix.last_logits.device)
    start = prefix.cache.length
    hidden = model.hidden(ids, cache=prefix.cache, valid=valid)
    out = model.logits(hidden)
    logits = torch.cat((prefix.last_logits[:, None].to(out.dtype), out[:, :-1]), dim=1)
    logprobs = logits.float().log_softmax(-1).gather(-1, ids[..., None]).squeeze(-1)
    logprobs = logprobs * valid
    lengths = [len(c) for c in continuations]
    if keep:
        last = torch.tensor([max(n - 1, 0) for n in lengths], device=out.device)
        new_last = out[torch.arange(B, device=out.device), last]
        has = torch.tensor([n > 0 for n in lengths], device=out.device)[:, None]
        prefix.last_logits = torch.where(has, new_last, prefix.last_logits.to(out.dtype))
    else:
        prefix.cache.truncate(start)
    return Scores(logits, logprobs, lengths)


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one token per row of logits [B, V].

    Returns (tokens [B], model log-probs [B] at temperature 1, sampling log-probs [B])."""
    logits = logits.float()
    model_logprobs = logits.log_softmax(-1)
    if temperature <= 0:
        tokens = logits.argmax(-1)
        return (
            tokens,
            model_logprobs.gather(-1, tokens[:, None])[:, 0],
            torch.zeros_like(tokens, dtype=torch.float32),
        )
    probs = (logits / temperature).softmax(-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        # Keep the smallest prefix of the sorted vocabulary whose mass reaches top_p.
        keep = (sorted_p.cumsum(-1) - sorted_p) < top_p
        sorted_p = sorted_p * keep
        sorted_p = sorted_p / sorted_p.sum(-1, keepdim=True)
        choice = torch.multinomial(sorted_p, 1, generator=generator)
        tokens = order.gather(-1, choice)[:, 0]
        q = sorted_p.gather(-1, choice)[:, 0]
    else:
        tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]
        q = probs.gather(-1, tokens[:, None])[:, 0]
    return tokens, model_logprobs.gather(-1, tokens[:, None])[:, 0], q.log()


@torch.inference_mode()
def generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    stop_tokens: Iterable[int] = (),
    seed: int | None = None,
) -> list[Generation]:
    """Sample up to `max_new_tokens` tokens after each prompt (temperature 0: greedy).

    A sequence stops after sampling one of `stop_tokens` (kept as its last token)."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, found {max_new_tokens}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], found {top_p}")
    device = model.embed.weight.device
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    stops = torch.tensor(sorted(set(stop_tokens)), dtype=torch.long, device=device)
    B = len(prompts)
    out = [Generation([], [], "length", []) for _ in range(B)]
    if max_new_tokens == 0:
        _check_tokens(prompts, model.cfg.vocab_size, "prompt", allow_empty=False)
        return out
    with _eval_mode(model):
        prefix = prefill(model, prompts, capacity=max(len(p) for p in prompts) + max_new_tokens)
        logits = prefix.last_logits
        done = torch.zeros(B, dtype=torch.bool, device=device)
        steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for step in range(max_new_tokens):
            tokens, lp, slp = sample_next(logits, temperature, top_p, generator)
            active = ~done
            done = done | torch.isin(tokens, stops)
            steps.append((tokens, lp, slp, active))
            if step == max_new_tokens - 1 or bool(done.all()):
                break
            logits = model.logits(model.hidden(tokens[:, None], cache=prefix.cache))[:, -1]
    # One transfer at the end instead of a sync per token.
    tokens, lp, slp, active = (torch.stack(t, 1).tolist() for t in zip(*steps))
    stop_set = set(stops.tolist())
    for b in range(B):
        for i in range(len(tokens[b])):
            if not active[b][i]:
                break
            g = out[b]
            g.tokens.append(tokens[b][i])
            g.logprobs.append(lp[b][i])
            g.sampling_logprobs.append(slp[b][i])
            if tokens[b][i] in stop_set:
                g.finish_reason = "stop"
    return out
