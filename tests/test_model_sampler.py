"""KV-cache generation and scoring against transformers' greedy generate and full forwards."""

from __future__ import annotations

import pytest
import torch

import cadenza.model as cm
from model_oracle import hf_model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = hf_model("noqlora-groups-yarn", seed=3)
    path = tmp_path_factory.mktemp("ckpt")
    hf.save_pretrained(path)
    return hf, cm.from_pretrained(path).eval()


def _prompts(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _greedy_no_cache(model, prompt, n):
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt) :]


def test_greedy_matches_transformers_and_no_cache_forward(pair):
    hf, ours = pair
    prompts = _prompts(hf.config.vocab_size, [7, 7])
    n = 12
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor(prompts),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[:, 7:].tolist()
    got = cm.generate(ours, prompts, max_new_tokens=n, temperature=0.0)
    assert [g.tokens for g in got] == ref
    assert [g.finish_reason for g in got] == ["length", "length"]
    assert got[0].tokens == _greedy_no_cache(ours, prompts[0], n)


def test_left_padded_batch_matches_single_prompts(pair):
    hf, ours = pair
    prompts = _prompts(hf.config.vocab_size, [3, 9, 5], seed=1)
    got = cm.generate(ours, prompts, max_new_tokens=8, temperature=0.0)
    for p, g in zip(prompts, got):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([p]),
                max_new_tokens=8,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(p) :].tolist()
        assert g.tokens == ref


def test_logprobs_match_full_forward(pair):
    hf, ours = pair
    prompts = _prompts(hf.config.vocab_size, [4, 6], seed=2)
    got = cm.generate(ours, prompts, max_new_tokens=10, temperature=0.7, top_p=0.9, seed=5)
    again = cm.generate(ours, prompts, max_new_tokens=10, temperature=0.7, top_p=0.9, seed=5)
    assert [g.tokens for g in got] == [g.tokens for g in again]
    for p, g in zip(prompts, got):
        seq = torch.tensor([p + g.tokens])
        with torch.no_grad():
            logits = hf(seq).logits[0, len(p) - 1 : -1]
        tok = torch.tensor(g.tokens)
        ref = logits.log_softmax(-1).gather(-1, tok[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(g.logprobs), ref, atol=1e-5, rtol=0)
        # sampling distribution: temperature 0.7, then the 0.9 nucleus renormalized
        probs = (logits / 0.7).softmax(-1)
        sp, order = probs.sort(-1, descending=True)
        keep = (sp.cumsum(-1) - sp) < 0.9
        nucleus = torch.zeros_like(probs).scatter(-1, order, sp * keep)
        q = nucleus.gather(-1, tok[:, None])[:, 0] / nucleus.sum(-1)
        assert (q > 0).all()  # every sampled token lies in its nucleus
        torch.testing.assert_close(torch.tensor(g.sampling_logprobs), q.log(), atol=1e-4, rtol=0)


def test_stop_tokens_and_tiny_top_p_is_greedy(pair):
    hf, ours = pair
    prompts = _prompts(hf.config.vocab_size, [5, 8], seed=4)
    greedy = cm.generate(ours, prompts, max_new_tokens=6, temperature=0.0)
    nucleus = cm.generate(ours, prompts, max_new_tokens=6, temperature=1.0, top_p=1e-6, seed=0)
    assert [g.tokens for g in nucleus] == [g.tokens for g in greedy]
    assert all(abs(x) < 1e-6 for g in nucleus for x in g.sampling_logprobs)
    stop = greedy[0].tokens[2]
    got = cm.generate(ours, prompts, max_new_tokens=6, temperature=0.0, stop_tokens=[stop])
    first = greedy[0].tokens.index(stop)
    assert got[0].tokens == greedy[0].tokens[: first + 1]
    assert got[0].finish_reason == "stop"
    if stop in greedy[1].tokens:
        assert got[1].tokens == greedy[1].tokens[: greedy[1].tokens.index(stop) + 1]
    else:
        assert got[1].tokens == greedy[1].tokens and got[1].finish_reason == "length"


def test_score_continuations_on_a_shared_prefix(pair):
    hf, ours = pair
    V = hf.config.vocab_size
    prefix_tokens = _prompts(V, [6], seed=5)[0]
    conts = _prompts(V, [4, 7], seed=6)
    with torch.no_grad():
        pre = cm.prefill(ours, [prefix_tokens]).repeat(2)
        length = pre.cache.length
        scored = cm.score(ours, pre, conts)
        assert pre.cache.length == length  # rolled back: reusable
        again = cm.score(ours, pre, conts[::-1])
    for b, c in enumerate(conts):
        with torch.no_grad():
            logits = hf(torch.tensor([prefix_tokens + c])).logits[0, len(prefix_tokens) - 1 : -1]
        ref = logits.log_softmax(-1).gather(-1, torch.tensor(c)[:, None])[:, 0]
        torch.testing.assert_close(scored.logprobs[b, : len(c)], ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(scored.logits[b, : len(c)], logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(again.logprobs[1 - b, : len(c)], ref, atol=1e-5, rtol=0)
    assert scored.lengths == [4, 7] and (scored.logprobs[0, 4:] == 0).all()


def test_bad_inputs_are_clear_errors(pair):
    _, ours = pair
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        cm.generate(ours, [[1], []], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"outside \[0, 97\)"):
        cm.generate(ours, [[1, 500]], max_new_tokens=2)
