"""Data packing, schedule, metrics and progress: the pieces of pretraining without a model."""

import io
import json
import math

import pytest
import torch

from cadenza.log.metrics import MetricsWriter, read_jsonl, truncate_after
from cadenza.log.progress import Progress
from cadenza.train.data import (
    PackedBatches,
    build_corpus_data,
    pack_documents,
    split_documents,
)


def _docs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 500, (int(k),), generator=g).tolist() for k in
            torch.randint(1, 90, (n,), generator=g)]  # fmt: skip


def test_pack_documents_frames_each_document():
    docs = [[5, 6], [], [7]]
    assert pack_documents(docs, bos_id=1, eos_id=2).tolist() == [1, 5, 6, 2, 1, 2, 1, 7, 2]


@pytest.mark.parametrize("seq_len,batch", [(16, 4), (7, 3), (1, 1)])
def test_one_epoch_of_targets_covers_the_stream_exactly(seq_len, batch):
    stream = torch.arange(1000, 1000 + 503)  # distinct values: a token's position is its value
    data = PackedBatches(stream, seq_len, batch, seed=3)
    n = data.n_windows
    assert n == (len(stream) - 1) // seq_len
    batches_per_epoch = n // batch
    targets, inputs = [], []
    for b in range(batches_per_epoch):
        x, y = data.batch(b)
        assert x.shape == y.shape == (batch, seq_len)
        assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
        inputs.append(x.reshape(-1))
        targets.append(y.reshape(-1))
    seen = torch.cat(targets).sort().values
    # Every target in stream[1 : n*T + 1] exactly once (up to the < batch windows left over).
    covered = stream[1 : batches_per_epoch * batch * seq_len + 1]
    if batches_per_epoch * batch == n:
        assert torch.equal(seen, covered)
    else:
        assert len(seen.unique()) == len(seen) == batches_per_epoch * batch * seq_len
    # Each input is followed in the stream by its target.
    assert torch.equal(torch.cat(inputs) + 1, torch.cat(targets))


def test_batches_are_a_pure_function_of_position():
    stream = torch.randint(0, 50, (4000,), generator=torch.Generator().manual_seed(1))
    a = PackedBatches(stream, 32, 5, seed=7)
    b = PackedBatches(stream, 32, 5, seed=7)
    positions = [0, 1, 30, 24, 25, 200, 3]  # out of order, across epoch boundaries
    for p in positions:
        assert all(torch.equal(u, v) for u, v in zip(a.batch(p), b.batch(p)))
    later = [a.batch(p)[0] for p in range(60)]
    fresh = PackedBatches(stream, 32, 5, seed=7)
    assert torch.equal(fresh.batch(59)[0], later[59])
    other = PackedBatches(stream, 32, 5, seed=8)
    assert not torch.equal(other.batch(0)[0], a.batch(0)[0])
    # Each epoch is a permutation of all windows.
    ids = a.window_ids(0, 3 * a.n_windows).view(3, -1)
    for row in ids:
        assert torch.equal(row.sort().values, torch.arange(a.n_windows))
    assert not torch.equal(ids[0], ids[1])


def test_validation_split_holds_out_whole_documents():
    train, val = split_documents(50, 0.1, seed=0)
    assert len(val) == 5 and not set(train) & set(val) and sorted(train + val) == list(range(50))
    assert split_documents(50, 0.1, seed=0) == (train, val)
    docs = [[100 + i] * 40 for i in range(50)]  # document i is made of token 100+i
    data = build_corpus_data(docs, 1, 2, seq_len=8, batch_size=2, val_fraction=0.1, seed=0)
    val_tokens = set(data.val.stream.tolist()) - {1, 2}
    train_tokens = set(data.train.stream.tolist()) - {1, 2}
    assert val_tokens == {100 + i for i in val} and not val_tokens & train_tokens
    assert data.n_val_docs == 5
    with pytest.raises(ValueError, match="at least 2"):
        split_documents(1, 0.1, 0)
    with pytest.raises(ValueError, match="fewer than one window"):
        build_corpus_data([[3], [4]], 1, 2, seq_len=64, batch_size=2, val_fraction=0.5, seed=0)


def test_metrics_jsonl_and_truncate(tmp_path):
    path = tmp_path / "m.jsonl"
    with MetricsWriter(path) as m:
        for s in range(1, 6):
            m.write({"step": s, "loss": torch.tensor(1.0 / s), "bad": math.nan})
    with open(path, "a") as f:
        f.write('{"step": 6, "loss"')  # a torn line from a kill
    recs = read_jsonl(path)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    assert recs[1]["loss"] == 0.5 and recs[0]["bad"] == "nan"
    assert truncate_after(path, 3) == 3
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3]


def test_plain_progress_prints_every_n_steps():
    buf = io.StringIO()
    with Progress(total=25, start=0, every=10, stream=buf) as p:
        for s in range(1, 26):
            p.update(s, loss=2.5, tokens_per_s=1234.0)
        p.print("note")
    lines = buf.getvalue().splitlines()
    assert [ln.split()[2] for ln in lines[:3]] == ["10/25", "20/25", "25/25"]
    assert "loss 2.5000" in lines[0] and "1,234 tok/s" in lines[0] and "eta" in lines[0]
    assert lines[-1] == "note"
    rich_buf = io.StringIO()
    with Progress(total=5, stream=rich_buf, rich=True) as p:
        p.update(5, loss=1.0, tokens_per_s=10.0)
    assert "5/5" in rich_buf.getvalue()
