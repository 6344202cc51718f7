import json

import pytest

from cadenza.model.tokenizer import (
    BOS,
    EOS,
    IM_END,
    IM_START,
    PAD,
    SPECIAL_TOKENS,
    TOOL_CALL,
    Tokenizer,
    TokenizerError,
    train_tokenizer,
)
from cadenza.train.corpus import CorpusError, corpus_files

TRAIN_BYTES = 400_000


@pytest.fixture(scope="module")
def files():
    return corpus_files("stdlib", max_bytes=2_000_000)


@pytest.fixture(scope="module")
def tok(files):
    return train_tokenizer(files, vocab_size=1024, max_bytes=TRAIN_BYTES)


def _unseen_texts(files):
    """Stdlib files past the training cap: code the tokenizer never saw."""
    seen = 0
    out = []
    for f in files:
        n = f.stat().st_size
        seen += n
        if seen > TRAIN_BYTES * 2:
            try:
                out.append(f.read_text(encoding="utf-8"))
            except UnicodeDecodeError:
                continue
        if len(out) == 12:
            break
    return out


ODD_TEXTS = [
    "def f(x):\n\treturn x  # tab indented\r\n",
    "s = 'héllo wörld ✓ 你好 🐍'\n",
    "    \n\n   trailing spaces   \n",
    "x = '<|im_start|>'  # special text inside code",
    "",
    "\x00\x01 bytes \u200b zero-width",
]


def test_round_trip_on_unseen_code(tok, files):
    texts = _unseen_texts(files) + ODD_TEXTS
    assert len(texts) > len(ODD_TEXTS)
    for allow_special in (True, False):
        ids = tok.encode_batch(texts, allow_special=allow_special)
        assert tok.decode_batch(ids) == texts
    # A trained vocabulary actually compresses code (byte-level would be 1 byte per token).
    code = "\n".join(texts[: -len(ODD_TEXTS)])
    assert len(code.encode()) / len(tok.encode(code)) > 2.0


def test_special_tokens_have_fixed_ids(tok):
    assert [tok.token_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.special_ids[TOOL_CALL] == 5
    assert tok.vocab_size == 1024


def test_chat_tokens_encode_as_single_ids_only_when_allowed(tok):
    text = f"{IM_START}user\nfix the bug{IM_END}"
    ids = tok.encode(text)
    assert ids[0] == tok.token_id(IM_START) and ids[-1] == tok.token_id(IM_END)
    plain = tok.encode(text, allow_special=False)
    assert not set(plain) & set(range(len(SPECIAL_TOKENS)))
    assert tok.decode(plain) == text
    # the flag does not leak into later calls
    assert tok.encode(text) == ids
    assert tok.encode("x", add_bos=True, add_eos=True) == [1, *tok.encode("x"), 2]
    assert tok.decode([1, *tok.encode("x"), 2], skip_special_tokens=True) == "x"


def test_training_is_deterministic(files, tok):
    again = train_tokenizer(files, vocab_size=1024, max_bytes=TRAIN_BYTES)
    assert again.hf.get_vocab() == tok.hf.get_vocab()


def test_save_load_and_transformers_agree(tok, tmp_path):
    path = tok.save(tmp_path / "tk")
    loaded = Tokenizer.from_file(tmp_path / "tk")
    text = "import os\n\nclass A:\n    def run(self):  # é\n        return os.getcwd()\n"
    assert loaded.encode(text) == tok.encode(text)
    assert path.name == "tokenizer.json"
    assert not list((tmp_path / "tk").glob("*.tmp"))

    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tmp_path / "tk"))
    assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
    assert (hf.bos_token, hf.eos_token, hf.pad_token) == (BOS, EOS, PAD)
    assert hf.convert_tokens_to_ids(IM_END) == tok.token_id(IM_END)


def test_bad_tokenizer_files_give_clear_errors(tmp_path, tok):
    with pytest.raises(TokenizerError, match="no tokenizer at .*cadenza tokenizer train"):
        Tokenizer.from_file(tmp_path / "nope")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError, match="not a valid tokenizer.json"):
        Tokenizer.from_file(bad)
    # A valid tokenizer.json without cadenza's specials.
    data = json.loads(tok.hf.to_str())
    data["added_tokens"] = []
    data["model"]["vocab"] = {k: v for k, v in data["model"]["vocab"].items() if "<|" not in k}
    (tmp_path / "nospecial.json").write_text(json.dumps(data))
    with pytest.raises(TokenizerError, match=r"lacks the special token"):
        Tokenizer.from_file(tmp_path / "nospecial.json")
    with pytest.raises(TokenizerError, match="too small"):
        train_tokenizer([], vocab_size=100)
    with pytest.raises(TokenizerError, match="no training text"):
        train_tokenizer([tmp_path / "missing.py"], vocab_size=512)


def test_corpus_order_is_deterministic_and_capped(tmp_path):
    a = corpus_files("stdlib", max_bytes=500_000)
    assert a == corpus_files("stdlib", max_bytes=500_000)
    assert sum(p.stat().st_size for p in a) <= 500_000
    assert all(p.suffix == ".py" and "site-packages" not in p.parts for p in a)
    assert len(corpus_files("stdlib", max_files=7)) == 7
    with pytest.raises(CorpusError, match="expected 'stdlib' or a directory"):
        corpus_files(str(tmp_path / "absent"))
    with pytest.raises(CorpusError, match="no .py files"):
        corpus_files(str(tmp_path))


def test_cli_tokenizer_train(tmp_path):
    from typer.testing import CliRunner

    from cadenza.cli.main import app

    src = tmp_path / "src"
    src.mkdir()
    for i in range(20):
        (src / f"m{i}.py").write_text(f"def func_{i}(a, b):\n    return a * {i} + b\n" * 20)
    runner = CliRunner()
    args = ["tokenizer", "train", "--corpus", str(src), "--out", str(tmp_path / "tk")]
    r = runner.invoke(app, [*args, "--vocab-size", "300"])
    assert r.exit_code == 0, r.output
    tok = Tokenizer.from_file(tmp_path / "tk")
    assert tok.decode(tok.encode("def func_3(a, b):")) == "def func_3(a, b):"
    r = runner.invoke(app, ["tokenizer", "encode", "--tokenizer", str(tmp_path / "tk"), "def f"])
    assert r.exit_code == 0 and r.output.split("\n")[0] == " ".join(map(str, tok.encode("def f")))
    r = runner.invoke(app, ["tokenizer", "train", "--corpus", str(tmp_path / "absent")])
    assert r.exit_code == 2 and "expected 'stdlib' or a directory" in r.output
