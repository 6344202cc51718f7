"""A synthetic tool-use environment small enough to train against in minutes on a CPU.

Each task is a digit x; the answer is g(x) = (3x + 1) mod 10. The episode, in a word-level
vocabulary, is

    system:     <s> <system> tools : calc lookup <end>
    user:       <user> x <end>
    assistant:  <assistant> TOOL ARG <end>          (TOOL, ARG sampled)
    tool:       <tool> RESULT <end>                 (g(ARG) for calc/lookup, `error` otherwise)
    assistant:  <assistant> ANSWER <end>            (ANSWER sampled)

reward = 1 if ANSWER == g(x). A call to a tool that does not exist is recorded as the
assistant turn's `unknown_tool` error; the policy can still answer from memory, so such a
call costs little final reward: exactly the case where trajectory RL is a weak signal and a
targeted hint ("Reminder: available tools: calc, lookup.") is a strong one.

`ToyPolicy` is a small causal LM (embedding, GRU, head) and `warmup` gives it the behavior
of a pretrained model: it follows a reminder placed right before its turn, but without one it
calls a non-existent tool in ~30% of episodes, and answers correctly from memory ~85% of
the time after a failed call.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cadenza.agent.episode import Episode, ToolCall, Turn
from cadenza.rl.feedback import FeedbackContext, UnknownTool

VALID_TOOLS = ("calc", "lookup")
INVALID_TOOLS = ("search", "grep", "run", "exec", "open", "find")
DIGITS = tuple(str(d) for d in range(10))
SPECIAL = ("<pad>", "<unk>", "<s>", "<system>", "<user>", "<assistant>", "<tool>", "<end>")
WORDS = ("tools", "error", "Reminder", "available", "does", "not", "exist")
PUNCT = (":", ",", ".", "(", ")")
VOCAB = SPECIAL + WORDS + PUNCT + VALID_TOOLS + INVALID_TOOLS + DIGITS
TOK = {w: i for i, w in enumerate(VOCAB)}
TOOL_IDS = [TOK[t] for t in VALID_TOOLS + INVALID_TOOLS]
DIGIT_IDS = [TOK[d] for d in DIGITS]
TOOL_SPECS = {t: {"required": ["x"], "properties": {"x": {}}} for t in VALID_TOOLS}


def answer_of(x: int) -> int:
    return (3 * x + 1) % 10


TEXT_TOK = {w: TOK[w] for w in VOCAB if w not in SPECIAL}


def encode(text: str) -> list[int]:
    """Word-level tokenizer: words and punctuation of VOCAB, anything else <unk>.

    Text never produces special tokens: a hint that quotes "<end>" (say, a tool name the
    policy made up) must not close the message it sits in."""
    unk = TOK["<unk>"]
    return [TEXT_TOK.get(w, unk) for w in re.findall(r"<\w+>|\w+|[^\w\s]", text)]


def render_hint(text: str) -> list[int]:
    """A hint as a whole user message, the unit inserted at a message boundary."""
    return [TOK["<user>"], *encode(text), TOK["<end>"]]


SYSTEM = [TOK["<s>"], TOK["<system>"], TOK["tools"], TOK[":"]] + [TOK[t] for t in VALID_TOOLS]
SYSTEM = SYSTEM + [TOK["<end>"]]


class ToyPolicy(nn.Module):
    """Causal LM: logits[b, t] predict token t + 1 from tokens <= t."""

    def __init__(self, vocab: int = len(VOCAB), dim: int = 64):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.rnn = nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.rnn(self.emb(ids))[0])


def micro_causal_lm() -> nn.Module:
    """cadenza's DeepSeek-V3-style CausalLM (MLA, MoE) at a size the toy task trains fast."""
    from cadenza.config.model import ModelConfig
    from cadenza.model import CausalLM

    cfg = ModelConfig(
        vocab_size=len(VOCAB),
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=4,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        max_position_embeddings=128,
    )
    return CausalLM(cfg)


@dataclass
class ToyTask:
    task_id: str
    x: int


def _tool_result(tool: int, arg: int) -> int:
    name = VOCAB[tool]
    if name in VALID_TOOLS and VOCAB[arg] in DIGITS:
        return TOK[str(answer_of(int(VOCAB[arg])))]
    return TOK["error"]


def _sample(logits: Tensor, temperature: float, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Sample from the full vocabulary; returns (token ids [N], their logprobs [N]).

    Unconstrained on purpose: the behavior logprobs must be those of the distribution the
    trainer scores (a tool-name slot filled with a non-tool word is an invalid call)."""
    logp = F.log_softmax(logits.float() / temperature, dim=-1)
    tok = torch.multinomial(logp.exp(), 1, generator=gen)[:, 0]
    return tok, logp.gather(-1, tok[:, None])[:, 0]


class ToyEnv:
    name = "toy"

    def __init__(self, temperature: float = 1.0, max_context: int = 64):
        self.temperature = temperature
        self.max_context = max_context

    def sample_tasks(self, n: int, rng: random.Random) -> list[ToyTask]:
        out = []
        for _ in range(n):
            x = rng.randrange(10)
            out.append(ToyTask(f"toy-{x}", x))
        return out

    def feedback_context(self, task: ToyTask) -> FeedbackContext:
        return FeedbackContext(tools=dict(TOOL_SPECS))

    def render_hint(self, text: str, episode: Episode, turn_index: int) -> list[int]:
        """Hint tokens for the boundary before `turn_index` (a chat template may need the
        history; this word-level format does not)."""
        return render_hint(text)

    @torch.no_grad()
    def rollout(
        self, model: nn.Module, tasks: list[ToyTask], group_size: int, gen: torch.Generator
    ) -> list[list[Episode]]:
        """G graded episodes per task, all sampled in one batch (every episode has the same
        layout, so slots line up across the batch)."""
        xs = [t.x for t in tasks for _ in range(group_size)]
        n = len(xs)
        prefix = [
            SYSTEM + [TOK["<user>"], TOK[str(x)], TOK["<end>"], TOK["<assistant>"]] for x in xs
        ]
        ids = torch.tensor(prefix)
        tool, lp_tool = _sample(model(ids)[:, -1], self.temperature, gen)
        ids = torch.cat([ids, tool[:, None]], 1)
        arg, lp_arg = _sample(model(ids)[:, -1], self.temperature, gen)
        result = torch.tensor([_tool_result(int(t), int(a)) for t, a in zip(tool, arg)])
        tail = torch.tensor([TOK["<end>"], TOK["<tool>"]]).expand(n, 2)
        ids = torch.cat([ids, arg[:, None], tail, result[:, None]], 1)
        ids = torch.cat([ids, torch.tensor([TOK["<end>"], TOK["<assistant>"]]).expand(n, 2)], 1)
        ans, lp_ans = _sample(model(ids)[:, -1], self.temperature, gen)
        ids = torch.cat([ids, ans[:, None], torch.full((n, 1), TOK["<end>"])], 1)
        episodes = [
            self._episode(
                tasks[k // group_size], ids[k].tolist(), (lp_tool[k], lp_arg[k], lp_ans[k])
            )
            for k in range(n)
        ]
        return [episodes[i : i + group_size] for i in range(0, n, group_size)]

    def _episode(self, task: ToyTask, ids: list[int], lps) -> Episode:
        s = len(SYSTEM)
        a1, t1, a2 = s + 3, s + 7, s + 10  # starts of assistant, tool, assistant turns
        mask = [False] * len(ids)
        blp = [0.0] * len(ids)
        for pos, lp in zip((a1 + 1, a1 + 2, a2 + 1), lps):
            mask[pos], blp[pos] = True, float(lp)
        tool, arg, result, ans = (
            VOCAB[ids[a1 + 1]],
            VOCAB[ids[a1 + 2]],
            VOCAB[ids[t1 + 1]],
            VOCAB[ids[a2 + 1]],
        )
        arguments = {"x": int(arg)} if arg in DIGITS else None
        if tool not in VALID_TOOLS:
            errors = ["unknown_tool"]
        elif arguments is None:
            errors = ["invalid_arguments"]
        else:
            errors = []
        turns = [
            Turn("system", 0, s, "tools: " + " ".join(VALID_TOOLS)),
            Turn("user", s, a1, str(task.x)),
            Turn(
                "assistant",
                a1,
                t1,
                f"{tool} {arg}",
                [ToolCall(tool, arguments, f"{tool} {arg}")],
                errors,
            ),
            Turn("tool", t1, a2, result, observation=result, tool_name=tool),
            Turn("assistant", a2, len(ids), ans),
        ]
        correct = ans == str(answer_of(task.x))
        return Episode(
            task.task_id,
            ids,
            mask,
            blp,
            turns,
            reward=float(correct),
            resolved=correct,
            finish_reason="submit",
        )


def _demo(rng: random.Random, hinted: bool, p_invalid: float, p_recall: float) -> list[int]:
    x = rng.randrange(10)
    seq = SYSTEM + [TOK["<user>"], TOK[str(x)], TOK["<end>"]]
    if hinted:
        bad = rng.choice(INVALID_TOOLS + ("<made-up>", "7"))
        text = UnknownTool.hint_text(VALID_TOOLS, [bad] if rng.random() < 0.5 else [])
        seq += render_hint(text)
        tool = rng.choice(VALID_TOOLS)
    else:
        tool = rng.choice(INVALID_TOOLS if rng.random() < p_invalid else VALID_TOOLS)
    seq += [TOK["<assistant>"], TOK[tool], TOK[str(x)], TOK["<end>"]]
    result = _tool_result(TOK[tool], TOK[str(x)])
    seq += [TOK["<tool>"], result, TOK["<end>"], TOK["<assistant>"]]
    if result != TOK["error"] or rng.random() < p_recall:
        ans = answer_of(x)
    else:
        ans = rng.randrange(10)
    return seq + [TOK[str(ans)], TOK["<end>"]]


def warmup(
    model: nn.Module,
    steps: int = 300,
    batch: int = 64,
    seed: int = 0,
    p_invalid: float = 0.3,
    p_recall: float = 0.97,
    lr: float = 1e-2,
) -> float:
    """Supervised warm-up on demonstrations (half with a reminder before the call turn);
    returns the final cross-entropy. Loss only on the tokens a policy would sample."""
    rng = random.Random(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sampled = set(TOOL_IDS + DIGIT_IDS)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        seqs = [_demo(rng, rng.random() < 0.5, p_invalid, p_recall) for _ in range(batch)]
        width = max(len(s) for s in seqs)
        ids = torch.tensor([s + [TOK["<pad>"]] * (width - len(s)) for s in seqs])
        logits = model(ids[:, :-1])
        target = ids[:, 1:]
        # targets: tool/digit slots right after <assistant> or a tool name (not the user's x)
        prev = ids[:, :-1]
        is_slot = (prev == TOK["<assistant>"]) | torch.isin(prev, torch.tensor(TOOL_IDS))
        weight = (is_slot & torch.isin(target, torch.tensor(sorted(sampled)))).float()
        ce = F.cross_entropy(logits.transpose(1, 2), target, reduction="none")
        loss = (ce * weight).sum() / weight.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())
