"""Training data: each data-parallel replica's rows of every global batch, deterministically,
with a read position that a checkpoint saves and a resumed job restores.

Three sources, one interface (`Batches`: `next()` → this replica's (inputs, targets),
`state_dict()` / `load_state_dict()` for the read position):

  TokenFileBatches  a pre-tokenized file: a flat array of uint16 or uint32 token ids with no
                    header, read with numpy.memmap — the `train.bin` nanoGPT's prepare scripts
                    write, and the `.bin` of a Megatron-LM indexed dataset.
  RandomBatches     random tokens (launch.py --data random), for smoke tests and timing.
  IterableBatches   any other source: a function returning an iterable of global batches.
  DocumentBatches   any of them as packed documents (launch.py --eod ID / --documents): each
                    row's documents from its end-of-document tokens, or the doc ids a data
                    function yields as a third item; next() → ((input_ids, position_ids,
                    attention_mask), targets), reordered over the context ranks
                    (autopar/documents.py).

Samples of a token file: the file is cut into N = (tokens − 1) // seq windows of seq + 1
tokens, window w = tokens [w·seq, w·seq + seq + 1) (inputs its first seq tokens, targets its
last seq: next-token prediction). The windows are visited in a seeded random order, a fresh
permutation every epoch (Megatron-LM's shuffled sample index). Global batch k is samples
[k·B, (k+1)·B) of that order; replica r of d reads rows [r·B/d, (r+1)·B/d) of it — only those
(a memmap touches only the pages it reads). The read position is the number of samples
consumed; it depends only on the steps taken, not on d, so a job resumed on another number of
GPUs with the same global batch sees the data it would have seen.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Protocol

import numpy as np
import torch

from autopar.factory import import_function

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


@dataclass(frozen=True, kw_only=True)
class BatchShape:
    """Global batch size and sequence length, and which rows of each global batch this
    data-parallel replica (dp_rank of dp_size) reads."""
    global_batch_size: int
    seq_len: int
    dp_rank: int = 0
    dp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("global_batch_size", "seq_len", "dp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"BatchShape.{name}={value!r}: must be a positive integer")
        if self.global_batch_size % self.dp_size:
            raise ValueError(f"BatchShape: global_batch_size={self.global_batch_size} is not "
                             f"divisible by dp_size={self.dp_size}; every replica reads the "
                             f"same number of rows — pick a global batch that d divides")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"BatchShape.dp_rank={self.dp_rank}: must lie in [0, "
                             f"dp_size={self.dp_size})")

    @property
    def rows(self) -> range:
        """This replica's rows of a global batch."""
        share = self.global_batch_size // self.dp_size
        return range(self.dp_rank * share, (self.dp_rank + 1) * share)


class Batches(Protocol):
    """A data source of one replica: its rows of each global batch, in order."""

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This replica's (inputs, targets) of the next global batch: (B/d, seq) token ids."""

    def state_dict(self) -> dict[str, Any]:
        """The read position (JSON-serialisable), for the checkpoint."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position state_dict() returned (ValueError if it is another source's)."""


class _SampleBatches:
    """Sources with random access to sample g (a window of seq + 1 tokens): the position is
    the number of samples consumed; subclasses give `_sample(g)` and `_identity()`."""

    kind = ""

    def __init__(self, shape: BatchShape):
        self.shape = shape
        self.position = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.stack([self._sample(self.position + i) for i in self.shape.rows])
        self.position += self.shape.global_batch_size
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "position": self.position, **self._identity()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = {"kind": self.kind, **self._identity()}
        theirs = {k: state.get(k) for k in mine}
        if theirs != mine:
            diff = ", ".join(f"{k} {theirs[k]!r} (now {mine[k]!r})"
                             for k in mine if theirs[k] != mine[k])
            raise ValueError(f"data: the checkpoint's read position is for other data — {diff}; "
                             f"resume with the same data, sequence length and seed, or start "
                             f"a new checkpoint path")
        self.position = int(state["position"])

    def _sample(self, g: int) -> torch.Tensor:
        raise NotImplementedError

    def _identity(self) -> dict[str, Any]:
        raise NotImplementedError


class TokenFile:
    """A flat file of token ids (no header) opened with numpy.memmap, read-only.

    dtype: "uint16" or "uint32"; None picks uint16 when vocab_size <= 65,536 (nanoGPT's
    choice for GPT-2's 50,257 tokens) and uint32 above. vocab_size: ids must lie below it
    (checked on every read).
    """

    def __init__(self, path: str | Path, *, dtype: str | None = None,
                 vocab_size: int | None = None):
        self.path = Path(path)
        if dtype is None:
            if vocab_size is None:
                raise ValueError(f"TokenFile({str(path)!r}): give dtype ('uint16' or 'uint32') "
                                 f"or vocab_size, from which the dtype follows")
            dtype = "uint16" if vocab_size <= 2 ** 16 else "uint32"
        if dtype not in TOKEN_DTYPES:
            raise ValueError(f"token dtype {dtype!r}: must be one of {sorted(TOKEN_DTYPES)} "
                             f"(the flat token files of nanoGPT and Megatron-LM)")
        if not self.path.is_file():
            raise ValueError(f"data file {str(path)!r} does not exist; pass a flat "
                             f"uint16/uint32 token file (e.g. nanoGPT's train.bin) or 'random'")
        itemsize = np.dtype(TOKEN_DTYPES[dtype]).itemsize
        size = self.path.stat().st_size
        if size == 0 or size % itemsize:
            raise ValueError(f"{self.path}: {size} bytes is not a whole, non-zero number of "
                             f"{dtype} tokens ({itemsize} bytes each); check the file, or its "
                             f"dtype (--data-dtype)")
        self.dtype, self.vocab_size = dtype, vocab_size
        self.tokens = np.memmap(self.path, dtype=TOKEN_DTYPES[dtype], mode="r")

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def read(self, start: int, count: int) -> torch.Tensor:
        """Tokens [start, start + count) as int64, each checked against vocab_size."""
        ids = torch.from_numpy(np.asarray(self.tokens[start:start + count], dtype=np.int64))
        if self.vocab_size is not None and ids.numel() and int(ids.max()) >= self.vocab_size:
            at = start + int(torch.argmax((ids >= self.vocab_size).to(torch.uint8)))
            raise ValueError(
                f"{self.path}: token id {int(self.tokens[at])} at token {at} is not below the "
                f"model's vocabulary size {self.vocab_size}; the file was written for another "
                f"tokenizer or with another dtype than {self.dtype} (--data-dtype)")
        return ids


class TokenFileBatches(_SampleBatches):
    """Windows of a TokenFile in a seeded order, a new permutation each epoch (module doc)."""

    kind = "tokens"

    def __init__(self, file: TokenFile, shape: BatchShape, *, seed: int = 0):
        super().__init__(shape)
        self.file, self.seed = file, seed
        self.windows = (len(file) - 1) // shape.seq_len
        if self.windows < 1:
            raise ValueError(f"{file.path}: {len(file)} tokens, fewer than one sample of "
                             f"seq_len + 1 = {shape.seq_len + 1}; use a longer file or a "
                             f"shorter sequence")
        self._epoch: tuple[int, torch.Tensor] | None = None

    def _order(self, epoch: int) -> torch.Tensor:
        if self._epoch is None or self._epoch[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch = (epoch, torch.randperm(self.windows, generator=g))
        return self._epoch[1]

    def _sample(self, g: int) -> torch.Tensor:
        window = int(self._order(g // self.windows)[g % self.windows])
        seq = self.shape.seq_len
        return self.file.read(window * seq, seq + 1)

    def _identity(self) -> dict[str, Any]:
        return {"tokens": len(self.file), "seq_len": self.shape.seq_len, "seed": self.seed}


class RandomBatches(_SampleBatches):
    """Random token ids in [0, vocab_size), sample g drawn from its own seeded generator."""

    kind = "random"

    def __init__(self, shape: BatchShape, *, vocab_size: int, seed: int = 0):
        super().__init__(shape)
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"RandomBatches: vocab_size={vocab_size!r} must be a positive "
                             f"integer (the model's vocabulary size)")
        self.vocab_size, self.seed = vocab_size, seed

    def _sample(self, g: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + g)
        return torch.randint(0, self.vocab_size, (self.shape.seq_len + 1,), generator=gen)

    def _identity(self) -> dict[str, Any]:
        return {"vocab_size": self.vocab_size, "seq_len": self.shape.seq_len, "seed": self.seed}


class IterableBatches:
    """Any other source: `make()` returns an iterable of global batches (inputs, targets),
    each (global_batch_size, seq_len), the same in every process and on every run. Each
    replica keeps its rows. The position is the number of batches taken; resuming calls
    make() again and skips that many."""

    def __init__(self, make: Callable[[], Iterable], shape: BatchShape, *, name: str = "data"):
        self.make, self.shape, self.name = make, shape, name
        self.doc_ids = True    # a third item (doc_ids) allowed: packed documents
        self.position = 0
        self._it: Iterator | None = None

    def next(self) -> tuple[torch.Tensor, ...]:
        if self._it is None:
            self._it = iter(self.make())
            for _ in range(self.position):
                self._take()
        batch = self._take()
        self.position += 1
        rows = self.shape.rows
        return tuple(x[rows.start:rows.stop] for x in batch)  # type: ignore[return-value]

    def _take(self) -> tuple[torch.Tensor, ...]:
        try:
            batch = next(self._it)  # type: ignore[arg-type]
        except StopIteration:
            raise ValueError(f"{self.name}: the iterable ended after {self.position} global "
                             f"batches; make it yield at least one batch per training step "
                             f"(cycle it, or train fewer steps)") from None
        want = (self.shape.global_batch_size, self.shape.seq_len)
        ok = (isinstance(batch, (tuple, list)) and len(batch) in (2, 3)
              and all(isinstance(x, torch.Tensor) and tuple(x.shape[:2]) == want
                      for x in batch))
        if not ok:
            got = ([tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                    for x in batch] if isinstance(batch, (tuple, list)) else type(batch).__name__)
            raise ValueError(f"{self.name}: global batch {self.position} is {got}; each item "
                             f"must be an (inputs, targets) pair of tensors shaped {want} "
                             f"(global batch size, sequence length), or (inputs, targets, "
                             f"doc_ids) for packed documents")
        if len(batch) == 3 and not self.doc_ids:
            raise ValueError(f"{self.name}: global batch {self.position} has a third item "
                             f"(doc_ids: packed documents); pass --documents (launch.py) / "
                             f"documents=True, or yield (inputs, targets) pairs")
        return tuple(batch)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "iterable", "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "iterable":
            raise ValueError(f"{self.name}: the checkpoint's read position is for "
                             f"{state.get('kind')!r} data, not this iterable; resume with the "
                             f"same --data, or start a new checkpoint path")
        self.position, self._it = int(state["position"]), None


class DocumentBatches:
    """A source's batches as packed documents (autopar/documents.py): the documents of each row
    from its EOD tokens (`eod`), or from the doc ids a data function yields as a third item
    (they win over eod); next() → ((input_ids, position_ids, attention_mask), targets), the
    row reordered by balance_order over `context` ranks. The read position is the source's."""

    def __init__(self, source: Any, *, eod: int | None, context: int = 1, name: str = "data"):
        self.source, self.eod, self.context, self.name = source, eod, context, name

    def next(self) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        from autopar.documents import check_doc_ids, doc_ids_from_eod, document_inputs
        batch = self.source.next()
        ids, targets = batch[0], batch[1]
        if len(batch) == 3:
            doc_ids = batch[2]
            check_doc_ids(doc_ids, tuple(ids.shape[:2]), self.name)
        elif self.eod is None:
            raise ValueError(f"{self.name}: packed documents need each row's boundaries; pass "
                             f"--eod ID (the end-of-document token), or yield (inputs, "
                             f"targets, doc_ids) from the data function")
        else:
            doc_ids = doc_ids_from_eod(ids, self.eod)
        return document_inputs(ids, targets, doc_ids, self.context)

    def state_dict(self) -> dict[str, Any]:
        return self.source.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.source.load_state_dict(state)


def open_batches(source: str | Callable[..., Iterable], shape: BatchShape, *,
                 vocab_size: int | None = None, seed: int = 0,
                 dtype: str | None = None, documents: bool = False, eod: int | None = None,
                 context: int = 1) -> Any:
    """The data source `source` names: "random", a token file's path, "file.py:function"
    (function(global_batch_size=, seq_len=) returns an iterable of global batches), or such a
    function itself; with documents (or an eod token id) as packed documents
    (DocumentBatches, balanced over `context` ranks)."""
    batches = _open(source, shape, vocab_size=vocab_size, seed=seed, dtype=dtype)
    if not (documents or eod is not None):
        if isinstance(batches, IterableBatches):
            batches.doc_ids = False
        return batches
    if eod is not None and vocab_size is not None and not 0 <= eod < vocab_size:
        raise ValueError(f"--eod {eod}: not a token id of the model's vocabulary [0, "
                         f"{vocab_size}); pass the tokenizer's end-of-document id (GPT-2's "
                         f"<|endoftext|> is 50256)")
    return DocumentBatches(batches, eod=eod, context=context,
                           name=getattr(batches, "name", str(source)))


def _open(source: str | Callable[..., Iterable], shape: BatchShape, *,
          vocab_size: int | None, seed: int, dtype: str | None) -> Batches:
    name = getattr(source, "__name__", "data")
    if isinstance(source, str) and source.rpartition(":")[0].endswith(".py"):
        source, name = import_function(source, role="data function",
                                       contract="returning an iterable of global batches")
    if callable(source):
        fn = source
        return IterableBatches(lambda: fn(global_batch_size=shape.global_batch_size,
                                          seq_len=shape.seq_len), shape, name=f"{name}()")
    if source == "random":
        if vocab_size is None:
            raise ValueError("--data random needs the vocabulary size: the model has no "
                             "config.vocab_size; pass --vocab V")
        return RandomBatches(shape, vocab_size=vocab_size, seed=seed)
    return TokenFileBatches(TokenFile(source, dtype=dtype, vocab_size=vocab_size), shape,
                            seed=seed)


def mean_doc_len(source: Any, eod: int, *, dtype: str | None = None,
                 vocab_size: int | None = None) -> float | None:
    """Tokens per EOD over the first MEASURE_TOKENS tokens of the token file `source` (a
    document longer than what was read counts as that long); None for another source
    ("random", a data function)."""
    from autopar.documents import MEASURE_TOKENS
    if not isinstance(source, str) or not Path(source).is_file():
        return None
    file = TokenFile(source, dtype=dtype or ("uint16" if vocab_size is None else None),
                     vocab_size=vocab_size)
    head = file.tokens[:MEASURE_TOKENS]
    return len(head) / max(1, int((head == eod).sum()))
