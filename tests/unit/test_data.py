"""Training data (autopar.data): a flat uint16/uint32 token file read through numpy.memmap,
random tokens and an iterable of global batches. Each data-parallel replica reads exactly its
rows of every global batch; the read position survives a checkpoint and is independent of d,
so a job resumed on another number of GPUs sees the data it would have seen."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from autopar.data import BatchShape, TokenFile, TokenFileBatches, open_batches


def _token_file(tmp_path, n=1000, vocab=300, dtype=np.uint16, name="tokens.bin"):
    ids = np.random.default_rng(0).integers(0, vocab, n).astype(dtype)
    path = tmp_path / name
    ids.tofile(path)
    return path, ids


def _shape(d=1, r=0, b=8, seq=10):
    return BatchShape(global_batch_size=b, seq_len=seq, dp_rank=r, dp_size=d)


@pytest.mark.parametrize("dtype, name", [(np.uint16, "uint16"), (np.uint32, "uint32")])
def test_samples_are_next_token_windows_of_the_file(tmp_path, dtype, name):
    path, ids = _token_file(tmp_path, vocab=70_000 if dtype == np.uint32 else 300, dtype=dtype)
    data = open_batches(str(path), _shape(), vocab_size=70_000, dtype=name)
    x, y = data.next()
    assert x.shape == y.shape == (8, 10) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])                  # targets: inputs shifted by one
    for row_x, row_y in zip(x, y):                           # each row a window at w·seq
        start = int(np.flatnonzero(
            [np.array_equal(ids[s:s + 10], row_x.numpy()) for s in range(0, 990, 10)])[0]) * 10
        assert np.array_equal(ids[start + 1:start + 11], row_y.numpy())


def test_replicas_read_their_rows_of_the_same_global_batches(tmp_path):
    path, _ = _token_file(tmp_path)
    whole = open_batches(str(path), _shape(), vocab_size=300)
    parts = [open_batches(str(path), _shape(d=4, r=r), vocab_size=300) for r in range(4)]
    for _ in range(15):                    # 15 × 8 samples > 99 windows: a second epoch
        x, y = whole.next()
        pieces = [p.next() for p in parts]
        assert torch.equal(torch.cat([p[0] for p in pieces]), x)
        assert torch.equal(torch.cat([p[1] for p in pieces]), y)


def test_epochs_visit_every_window_once_in_a_new_order(tmp_path):
    path, _ = _token_file(tmp_path, n=10 * 16 + 1)     # 16 windows of 10 (+1 target token)
    data = TokenFileBatches(TokenFile(path, dtype="uint16"), _shape(b=16), seed=3)
    first, second = data.next()[0], data.next()[0]
    key = lambda rows: sorted(tuple(r.tolist()) for r in rows)   # noqa: E731
    assert key(first) == key(second) and len(set(key(first))) == 16
    assert not torch.equal(first, second)


def test_position_resumes_under_another_data_parallel_size(tmp_path):
    path, _ = _token_file(tmp_path)
    ref = open_batches(str(path), _shape(), vocab_size=300, seed=7)
    for _ in range(3):
        ref.next()
    first = open_batches(str(path), _shape(d=4, r=1), vocab_size=300, seed=7)
    for _ in range(3):
        first.next()
    saved = first.state_dict()
    assert saved["position"] == 24 and saved["kind"] == "tokens"
    resumed = [open_batches(str(path), _shape(d=2, r=r), vocab_size=300, seed=7)
               for r in range(2)]
    for part in resumed:
        part.load_state_dict(saved)
    x, _ = ref.next()
    assert torch.equal(torch.cat([p.next()[0] for p in resumed]), x)


def test_random_and_iterable_sources(tmp_path):
    rand = [open_batches("random", _shape(d=2, r=r), vocab_size=50, seed=1) for r in range(2)]
    whole = open_batches("random", _shape(), vocab_size=50, seed=1)
    x, _ = whole.next()
    assert torch.equal(torch.cat([r.next()[0] for r in rand]), x) and int(x.max()) < 50

    def batches(global_batch_size, seq_len):
        for k in range(100):
            t = torch.full((global_batch_size, seq_len + 1), k)
            yield t[:, :-1], t[:, 1:]
    data = open_batches(batches, _shape(d=2, r=1))
    assert data.next()[0].shape == (4, 10) and int(data.next()[0][0, 0]) == 1
    state = data.state_dict()
    again = open_batches(batches, _shape(d=2, r=1))
    again.load_state_dict(state)
    assert int(again.next()[0][0, 0]) == 2
    hook = tmp_path / "my_data.py"
    hook.write_text("import torch\n\ndef batches(global_batch_size, seq_len):\n"
                    "    while True:\n        t = torch.zeros(global_batch_size, seq_len + 1,"
                    " dtype=torch.long)\n        yield t[:, :-1], t[:, 1:]\n")
    assert open_batches(f"{hook}:batches", _shape()).next()[0].shape == (8, 10)


def test_packed_documents_from_eod_tokens_and_from_a_functions_doc_ids(tmp_path):
    """--eod: each row's positions restart after every EOD and the mask keeps attention
    inside documents, for this replica's rows; a data function's (inputs, targets, doc_ids)
    give the boundaries themselves; the read position is the source's."""
    path, ids = _token_file(tmp_path, vocab=20)
    data = open_batches(str(path), _shape(d=2, r=1), vocab_size=20, eod=7)
    plain = open_batches(str(path), _shape(d=2, r=1), vocab_size=20)
    (x, pos, mask), y = data.next()
    x0, y0 = plain.next()
    assert torch.equal(x, x0) and torch.equal(y, y0) and mask.shape == (4, 1, 10, 10)
    for row in range(4):
        want, at = [], 0
        for tok in x[row].tolist():
            want.append(at)
            at = 0 if tok == 7 else at + 1
        assert pos[row].tolist() == want
        ends = (x[row] == 7).nonzero().flatten().tolist()
        if ends and ends[0] + 1 < 10:   # the token after an EOD sees only itself
            k = ends[0] + 1
            assert mask[row, 0, k].nonzero().flatten().tolist() == [k]
    assert data.state_dict() == plain.state_dict()

    def batches(global_batch_size, seq_len):
        while True:
            t = torch.arange(seq_len + 1).expand(global_batch_size, -1)
            yield t[:, :-1], t[:, 1:], (torch.arange(seq_len) // 4).expand(global_batch_size, -1)
    (x, pos, mask), _ = open_batches(batches, _shape(), documents=True).next()
    assert pos[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    (x2, _, mask2), _ = open_batches(batches, _shape(), documents=True, context=2).next()
    assert sorted(x2[0].tolist()) == x[0].tolist() and mask2.sum() == mask.sum()


@pytest.mark.parametrize("make, words", [
    (lambda p: TokenFile(p / "none.bin", dtype="uint16"), ["does not exist", "'random'"]),
    (lambda p: TokenFile(p / "tokens.bin", dtype="int8"), ["'int8'", "uint16"]),
    (lambda p: TokenFile(p / "odd.bin", dtype="uint32"), ["3 bytes", "--data-dtype"]),
    (lambda p: open_batches(str(p / "tokens.bin"), _shape(), vocab_size=100).next(),
     ["is not below the model's vocabulary size 100"]),
    (lambda p: open_batches(str(p / "tokens.bin"), _shape(seq=2000), vocab_size=300),
     ["fewer than one sample"]),
    (lambda p: open_batches("random", _shape()), ["--vocab"]),
    (lambda p: _shape(d=3), ["not divisible by dp_size=3"]),
    (lambda p: open_batches(lambda **kw: iter([]), _shape()).next(), ["ended after 0"]),
    (lambda p: open_batches(lambda **kw: iter([(torch.zeros(8, 9), torch.zeros(8, 9))]),
                            _shape()).next(), ["(8, 9)", "(8, 10)"]),
    (lambda p: open_batches("random", _shape(), vocab_size=9, eod=9), ["--eod 9", "[0, 9)"]),
    (lambda p: open_batches(lambda **kw: iter([(torch.zeros(8, 10),) * 3]), _shape()).next(),
     ["third item", "--documents"]),
    (lambda p: open_batches(lambda **kw: iter([(torch.zeros(8, 10), torch.zeros(8, 10))]),
                            _shape(), documents=True).next(), ["--eod ID", "doc_ids"]),
    (lambda p: open_batches(lambda **kw: iter([(torch.zeros(8, 10), torch.zeros(8, 10),
                                                torch.arange(10).flip(0).expand(8, -1))]),
                            _shape(), documents=True).next(), ["decrease along a row"]),
    (lambda p: open_batches("random", _shape(), vocab_size=9).load_state_dict(
        {"kind": "tokens", "position": 8}), ["other data", "kind 'tokens'"]),
])
def test_bad_data_is_one_line(tmp_path, make, words):
    _token_file(tmp_path)
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(ValueError) as err:
        make(tmp_path)
    assert "\n" not in str(err.value)
    for w in words:
        assert w in str(err.value), (w, str(err.value))
