import json

import pytest

from agent_support import byte_tokenizer
from cadenza.agent.chat_format import (
    CadenzaFormat,
    ChatFormatError,
    JinjaFormat,
    insert_message_before,
    load_chat_format,
)
from cadenza.agent.episode import Episode, Turn

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def test_cadenza_round_trip_against_tokenizer_decode(tok):
    fmt = CadenzaFormat(tok)
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": 'Fix "mul" \u00e9 <|im_end|>'},
        {
            "role": "assistant",
            "content": "ok",
            "tool_calls": [
                {
                    "id": "c0",
                    "type": "function",
                    "function": {"name": "read_file", "arguments": '{"path": "a.py"}'},
                }
            ],
        },
        {"role": "tool", "content": "1\tx = 1"},
    ]
    ids = fmt.encode_conversation(msgs, TOOLS)
    expected = (
        "<|bos|><|im_start|>system\nBe brief.\n\n# Tools\nCall a tool by writing <|tool_call|>"
        '{"name": NAME, "arguments": {...}}<|/tool_call|>. Available tools:\n'
        + json.dumps(TOOLS[0]["function"])
        + "\n<|im_end|>"
        '<|im_start|>user\nFix "mul" \u00e9 <|im_end|><|im_end|>'
        '<|im_start|>assistant\nok<|tool_call|>{"name": "read_file", "arguments": {"path": "a.py"}}'
        "<|/tool_call|><|im_end|>"
        "<|im_start|>tool\n<|tool_result|>1\tx = 1<|/tool_result|><|im_end|>"
        "<|im_start|>assistant\n"
    )
    assert tok.decode(ids, skip_special_tokens=False) == expected
    # Message text is plain text: a literal "<|im_end|>" typed by a user is not the end token.
    end = tok.token_to_id("<|im_end|>")
    assert ids.count(end) == 4
    assert fmt.stop_token_ids == [end, tok.token_to_id("<|eos|>")]
    # Per-message spans tile the prompt.
    p, spans = fmt.prompt_ids(msgs[:2], TOOLS)
    assert spans[0][0] == 0 and spans[0][1] == spans[1][0] and spans[1][1] == len(p)
    assert tok.decode(p[spans[1][0] : spans[1][1]], skip_special_tokens=False) == (
        '<|im_start|>user\nFix "mul" \u00e9 <|im_end|><|im_end|>'
    )


def test_cadenza_parse_and_close(tok):
    fmt = CadenzaFormat(tok)
    gen = tok.encode(
        'hi<|tool_call|>{"name": "submit", "arguments": {}}<|/tool_call|><|im_end|>'
    ).ids
    parsed = fmt.parse(gen)
    assert parsed.content == "hi" and parsed.calls[0].name == "submit" and not parsed.problems
    assert fmt.close_assistant_ids(gen) == []
    assert fmt.close_assistant_ids(gen[:-1]) == [tok.token_to_id("<|im_end|>")]


def test_missing_special_tokens_is_a_clear_error():
    from tokenizers import Tokenizer, models

    bare = Tokenizer(models.BPE(vocab={"a": 0}, merges=[]))
    with pytest.raises(ChatFormatError, match="lacks the cadenza chat special tokens"):
        CadenzaFormat(bare)


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{{ c.function | tojson }}\n</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_jinja_template_from_tokenizer_config(tok, tmp_path):
    tok2 = byte_tokenizer()  # ChatML tokens, but the checkpoint's template uses <tool_call> text
    tok2.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"})
    )
    fmt = load_chat_format(tmp_path)
    assert isinstance(fmt, JinjaFormat)
    msgs = [{"role": "user", "content": "hi"}]
    ids = fmt.encode_conversation(msgs)
    assert tok2.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    # Appending: generated ids (ending in the stop token), the closing, a tool message.
    gen = tok2.encode(
        '<tool_call>\n{"name": "run", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>'
    ).ids
    parsed = fmt.parse(gen)
    assert [c.name for c in parsed.calls] == ["run"] and parsed.calls[0].arguments == {
        "command": "ls"
    }
    closing = fmt.close_assistant_ids(gen)
    assert tok2.decode(closing, skip_special_tokens=False) == "\n"
    assistant = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "run", "arguments": {"command": "ls"}}}],
    }
    tool_ids = fmt.message_ids({"role": "tool", "content": "a.py"}, msgs + [assistant])
    assert tok2.decode(tool_ids, skip_special_tokens=False) == "<|im_start|>tool\na.py<|im_end|>\n"
    # The incremental sequence equals the template's own rendering of the whole conversation.
    whole = fmt.render(
        msgs + [assistant, {"role": "tool", "content": "a.py"}], add_generation_prompt=True
    )
    built = ids + gen + closing + tool_ids + fmt.generation_prompt_ids()
    assert tok2.decode(built, skip_special_tokens=False) == whole


def test_insert_message_before(tok):
    fmt = CadenzaFormat(tok)
    prompt, spans = fmt.prompt_ids([{"role": "user", "content": "task"}])
    gen = tok.encode("x<|im_end|>").ids
    ids = prompt + fmt.generation_prompt_ids() + gen
    turns = [
        Turn("user", *spans[0], text="task"),
        Turn("assistant", len(prompt), len(ids), text="x"),
    ]
    ep = Episode(
        "t", ids, [False] * (len(ids) - len(gen)) + [True] * len(gen), [0.0] * len(ids), turns
    )
    new, pos = insert_message_before(ep, 1, "user", "Reminder: tools", fmt)
    assert tok.decode(new, skip_special_tokens=False) == (
        "<|bos|><|im_start|>user\ntask<|im_end|><|im_start|>user\nReminder: tools<|im_end|>"
        "<|im_start|>assistant\nx<|im_end|>"
    )
    assert len(pos) == len(ids)
    assert [new[p] for p in pos] == ids  # every old token found at its mapped place
    assert pos[: len(prompt)] == list(range(len(prompt)))
    with pytest.raises(ValueError, match="hints go before assistant turns: \\[1\\]"):
        insert_message_before(ep, 0, "user", "x", fmt)


def test_wrapped_tokenizers_are_accepted(tok, tmp_path):
    class Wrapper:  # like cadenza.model.tokenizer.Tokenizer: the tokenizers object on .hf
        def __init__(self, hf):
            self.hf = hf

    tok.save(str(tmp_path / "tokenizer.json"))
    a = CadenzaFormat(Wrapper(tok)).encode_conversation([{"role": "user", "content": "hi"}])
    b = CadenzaFormat(tmp_path).encode_conversation([{"role": "user", "content": "hi"}])
    assert a == b == CadenzaFormat(tok).encode_conversation([{"role": "user", "content": "hi"}])
    with pytest.raises(ChatFormatError, match="no tokenizer.json"):
        CadenzaFormat(tmp_path / "missing")


def test_cadenza_tokenizer_from_the_pretrain_stack(tmp_path):
    """The format over a tokenizer trained by cadenza.model.tokenizer (its own specials)."""
    from cadenza.model.tokenizer import Tokenizer, train_tokenizer

    src = tmp_path / "corpus.py"
    src.write_text("def add(a, b):\n    return a + b\n" * 50)
    trained = train_tokenizer([src], vocab_size=300)
    trained.save(tmp_path / "tok")
    for fmt in (CadenzaFormat(trained), load_chat_format(tmp_path / "tok")):
        assert isinstance(fmt, CadenzaFormat)
        ids = fmt.encode_conversation([{"role": "user", "content": "def add(a, b):"}])
        assert trained.decode(ids) == (
            "<|bos|><|im_start|>user\ndef add(a, b):<|im_end|><|im_start|>assistant\n"
        )
        assert fmt.stop_token_ids == [trained.token_id("<|im_end|>"), trained.eos_id]
    assert isinstance(Tokenizer.from_file(tmp_path / "tok"), Tokenizer)
