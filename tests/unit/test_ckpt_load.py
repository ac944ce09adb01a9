"""The bounded checkpoint reader (autopar.runtime.ckpt_load): an overlap cut into spans of at
most the budget covers it exactly once, and a ranged read of a DCP item's bytes equals the
tensor saved, for every dtype and rank of tensor the checkpoints store; the writer's staged
pieces are copied no more by DCP, and the checksums kept while writing equal the files'; packs
(raw, ckpt_packs, and the uint8 tensor items written before) read back piece by piece; every
form a sharded save has written loads through its layout."""
from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from autopar.runtime.ckpt_load import PieceFile, read_boxes, safe_reader, spans
from autopar.runtime.ckpt_packs import PackWriter, packs_of
from autopar.runtime.ckpt_store import ChecksumFileSystem, file_records
from autopar.runtime.ckpt_writer import ProcessWriter


def _cells(box):
    return set(itertools.product(*[range(lo, hi) for lo, hi in box]))


def _span(shape, box):
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return sum((hi - 1 - lo) * s for (lo, hi), s in zip(box, strides)) + 1


def _random_sub(rng, value):
    """A random non-empty sub-box of `value` and its contents."""
    sub = []
    for n in value.shape:
        lo = rng.randint(0, n - 1)
        sub.append((lo, rng.randint(lo + 1, n)))
    want = value
    for dim, (lo, hi) in enumerate(sub):
        want = want.narrow(dim, lo, hi - lo)
    return sub, want


def test_spans_cover_the_box_once_within_the_budget():
    rng = random.Random(0)
    for _ in range(200):
        shape = [rng.randint(1, 6) for _ in range(rng.randint(1, 3))]
        box = []
        for n in shape:
            lo = rng.randint(0, n - 1)
            box.append((lo, rng.randint(lo + 1, n)))
        budget = rng.randint(1, 40)
        parts = spans(shape, box, budget)
        seen = [c for p in parts for c in _cells(p)]
        assert len(seen) == len(set(seen)) and set(seen) == _cells(box), (shape, box, budget)
        assert all(_span(shape, p) <= budget for p in parts), (shape, box, budget, parts)


def test_ranged_reads_equal_dcp_whole_reads(tmp_path: Path):
    gen = torch.Generator().manual_seed(0)
    items = {"a": torch.randn(7, 5, generator=gen), "b": torch.randn(3, 4, 6, generator=gen),
             "c": torch.randn(11, generator=gen).to(torch.bfloat16), "d": torch.tensor(3.0),
             "e": torch.randn(9, 8, generator=gen)[:, 2:5]}       # a view: stored compact
    # staged as an asynchronous save stages them: tensors whose storage is exactly the piece
    # (DCP copies nothing more), written with their checksums kept as the bytes go by
    staged = ProcessWriter().stage(items).pieces()
    assert all(torch.equal(staged[k], v) and staged[k].untyped_storage().nbytes() == v.nbytes
               for k, v in items.items())
    writer = dcp.FileSystemWriter(str(tmp_path))
    writer.fs = ChecksumFileSystem()
    dcp.save(staged, storage_writer=writer, no_dist=True)
    names = sorted(p.name for p in tmp_path.glob("*.distcp"))
    assert {n: writer.fs.written[n] for n in names} == file_records(tmp_path, names)
    files = PieceFile(tmp_path, safe_reader(tmp_path))
    rng = random.Random(1)
    try:
        for key, value in items.items():
            shape = list(value.shape)
            where = files.record(key, shape, value.dtype)
            assert where is not None, key                  # read in ranges, not whole
            for _ in range(10):
                sub, want = _random_sub(rng, value)
                before = files.read_bytes
                got = files.read(where, shape, value.dtype, sub)
                assert torch.equal(got, want), (key, sub)
                assert files.read_bytes - before == _span(shape, sub) * value.element_size()
    finally:
        files.close()


def test_packed_pieces_read_in_ranges_and_whole(tmp_path: Path):
    """An asynchronous save's packs (ckpt_writer.Staged.packed: consecutive pieces in a few
    uint8 items): every piece reads back from its pack at its byte offset, in ranges and
    whole through DCP, equal to the tensor staged."""
    gen = torch.Generator().manual_seed(2)
    items = {"a": torch.randn(7, 5, generator=gen), "b": torch.randn(3, 4, 6, generator=gen),
             "c": torch.randn(11, generator=gen).to(torch.bfloat16), "d": torch.tensor(3.0),
             "e": torch.randn(40, generator=gen)}
    packs, where = ProcessWriter().stage(items).packed("pack/0", 200)
    # pieces at 64-byte aligned offsets: a 140 | b 288 | c 22 + d 4 (68 bytes) | e 160
    assert len(packs.index) == 4 and set(where) == set(items)
    dcp.save(packs.pieces(), storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    files = PieceFile(tmp_path, safe_reader(tmp_path))
    rng = random.Random(3)
    try:
        for key, value in items.items():
            shape, ref = list(value.shape), where[key]
            loc = files.packed(ref, shape, value.dtype)
            assert loc is not None, key
            whole, nbytes = files.read_piece_whole(ref, shape, value.dtype)
            assert torch.equal(whole, value) and nbytes >= value.nbytes, key
            sub, want = _random_sub(rng, value)
            assert torch.equal(files.read(loc, shape, value.dtype, sub), want), (key, sub)
    finally:
        files.close()


def _items(seed):
    gen = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(7, 5, generator=gen), "b": torch.randn(3, 4, 6, generator=gen),
            "c": torch.randn(11, generator=gen).to(torch.bfloat16), "d": torch.tensor(3.0),
            "e": torch.randn(9, 8, generator=gen)[:, 2:5]}      # a strided view


def test_raw_packs_synchronous_and_staged_are_the_same_bytes_and_read_back(tmp_path: Path):
    """ckpt_packs: a synchronous save's packs (the pieces written one after another, a strided
    one copied alone) and an asynchronous save's (slices of the staged buffer) are the same
    file, byte for byte, whose CRC-32 kept while writing equals the file's; DCP's metadata
    holds them as bytes items; every piece reads back in ranges at its pack offset; a layout
    of the other byte order is refused in one line."""
    items = _items(4)
    sync, where = packs_of(items, "pack/0", 200)
    staged, where_staged = ProcessWriter().stage(items).packed("pack/0", 200)
    assert where == where_staged and len(sync) == 4
    files = {}
    for name, packs in (("sync", sync), ("staged", staged.packs())):
        writer = PackWriter(str(tmp_path / name))
        dcp.save(packs, storage_writer=writer, no_dist=True)
        assert writer.written == file_records(tmp_path / name, ["__0_0.distcp"]), name
        files[name] = (tmp_path / name / "__0_0.distcp").read_bytes()
    assert files["sync"] == files["staged"]
    pieces = PieceFile(tmp_path / "sync", safe_reader(tmp_path / "sync"))
    rng = random.Random(5)
    try:
        assert all(isinstance(m, BytesStorageMetadata)
                   for m in pieces.reader.metadata.state_dict_metadata.values())
        for key, value in items.items():
            shape = list(value.shape)
            loc = pieces.packed(where[key], shape, value.dtype)
            for _ in range(5):
                sub, want = _random_sub(rng, value) if shape else ([], value)
                assert torch.equal(pieces.read(loc, shape, value.dtype, sub), want), (key, sub)
    finally:
        pieces.close()
    other = "big" if sys.byteorder == "little" else "little"
    foreign = PieceFile(tmp_path / "sync", safe_reader(tmp_path / "sync"), other)
    with pytest.raises(ValueError, match=f"{other}-endian") as info:
        foreign.packed(where["a"], [7, 5], torch.float32)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("form", ["item per box", "uint8 tensor packs", "raw packs"])
def test_every_piece_form_loads_through_the_layout(tmp_path: Path, form: str):
    """Old files still load: the layouts of a sharded save's pieces as a DCP item each
    ([box, key]; the synchronous save's form until 2026-11-26), as byte ranges of uint8 tensor
    packs ([box, pack key, offset]; the asynchronous save's, 2026-11-26) and of raw packs (both
    saves' since) all fill the same targets through read_boxes, bit for bit."""
    full = {"w": torch.randn(6, 4, generator=torch.Generator().manual_seed(6)),
            "optim/step/w": torch.tensor(5.0)}
    pieces = {"w@[0:2,0:4]": full["w"][0:2], "w@[2:6,0:4]": full["w"][2:6],
              "optim/step/w": full["optim/step/w"]}
    boxes = {"w@[0:2,0:4]": [[0, 2], [0, 4]], "w@[2:6,0:4]": [[2, 6], [0, 4]],
             "optim/step/w": []}
    where = {k: None for k in pieces}
    if form == "item per box":
        dcp.save({k: v.clone() for k, v in pieces.items()},
                 storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    elif form == "uint8 tensor packs":
        staged, where = ProcessWriter().stage(pieces).packed("pack/0", 64)
        dcp.save(staged.pieces(), storage_writer=dcp.FileSystemWriter(str(tmp_path)),
                 no_dist=True)
    else:
        packs, where = packs_of(pieces, "pack/0", 64)
        dcp.save(packs, storage_writer=PackWriter(str(tmp_path)), no_dist=True)
    tensors: dict = {}
    for key, box in boxes.items():
        name = key.split("@")[0]
        piece = [box, key] if where[key] is None else [box, *where[key]]
        entry = tensors.setdefault(name, {"global_shape": list(full[name].shape),
                                          "split_dim": None, "dtype": str(full[name].dtype),
                                          "pieces": []})
        entry["pieces"].append(piece)
    got = {k: torch.full_like(v, float("nan")) for k, v in full.items()}
    stats = read_boxes(tmp_path, {"tensors": tensors},
                       [("w", got["w"][1:5], [(1, 5), (0, 4)]),
                        ("optim/step/w", got["optim/step/w"], [])], 64)
    assert torch.equal(got["w"][1:5], full["w"][1:5]) and stats.whole_items == 0
    assert torch.equal(got["optim/step/w"], full["optim/step/w"])


def test_a_file_system_refusing_direct_writes_gets_buffered_ones(tmp_path: Path, monkeypatch):
    """Some file systems accept an O_DIRECT open and refuse its writes (EINVAL): PackFile's
    probe finds it at open and writes buffered, the same bytes and CRC-32; where direct writes
    work the probe leaves nothing behind."""
    import errno
    import fcntl
    import os
    import zlib

    from autopar.runtime import ckpt_packs
    data = memoryview(bytes(range(256)) * 40)       # 10,240 bytes: not a block multiple
    ok = ckpt_packs.PackFile(str(tmp_path / "direct"))
    ok.write(data)
    ok.close()
    real_write = os.write

    def refuse_direct(fd, block):       # as such a file system: EINVAL on an O_DIRECT file
        if fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, block)
    monkeypatch.setattr(os, "write", refuse_direct)
    fallback = ckpt_packs.PackFile(str(tmp_path / "buffered"))
    assert not fallback.direct
    fallback.write(data)
    fallback.close()
    for name, f in (("direct", ok), ("buffered", fallback)):
        assert (tmp_path / name).read_bytes() == bytes(data), name
        assert f.crc == zlib.crc32(data) and f.size == len(data), name


def test_loaded_optimizer_state_sits_where_torchs_own_load_puts_it():
    """Adam's step: on the CPU, unless the group is fused or capturable (its kernels read it
    on the parameter's device: a CPU step failed a fused AdamW on an H100 after a load); the
    moments on the parameter's device and dtype. Meta parameters stand in for a GPU's, and
    torch's own load_state_dict is the reference."""
    from autopar.runtime.optim_state import state_value
    for flags in ({}, {"fused": True}, {"capturable": True}):
        param = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16, device="meta"))
        opt = torch.optim.AdamW([param], lr=1e-3, foreach=False, **flags)
        step = state_value(opt, param, torch.tensor(3.0, dtype=torch.float64))
        moment = state_value(opt, param, torch.ones(4, dtype=torch.float32))
        ref = torch.optim.AdamW([param], lr=1e-3, foreach=False, **flags)
        ref.load_state_dict({"state": {0: {"step": torch.tensor(3.0),
                                           "exp_avg": torch.ones(4)}},
                             "param_groups": opt.state_dict()["param_groups"]})
        want_step = ref.state[param]["step"]
        assert (step.device, step.dtype) == (want_step.device, torch.float32), flags
        assert step.device.type == ("meta" if flags else "cpu"), flags
        assert (moment.device.type, moment.dtype) == ("meta", torch.bfloat16), flags
