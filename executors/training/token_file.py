"""Batches from a token file (`examples/prepare_corpus.py` writes one): a flat array of token ids,
read through numpy.memmap, so a rank touches only the rows it needs.

Sampling is deterministic in (seed, step): row r of step s starts at an offset drawn from a
generator seeded with (seed, s), the same on every rank, so ranks agree on the batch without
talking, and a resumed run sees the same data order as one never stopped.

With packed documents (`eos`: the separator that ends each document) a row starts at a
document's first token, so that it holds whole documents and the last one cut at the row's end.
A document longer than a row, or a separator outside the vocabulary, is refused with where it is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tpc.ir.diagnostics import Diagnostic, TpirError

_DTYPES = {"uint16": np.uint16, "uint32": np.uint32, "int32": np.int32, "int64": np.int64}


def _refuse(message: str, hint: str) -> TpirError:
    return TpirError(Diagnostic(message, hint=hint))


class TokenFileBatches:
    """`get(step) -> (batch, seq+1)` int64 tokens; `rows(step, lo, hi)` reads only rows [lo, hi)."""

    def __init__(self, path: str, *, seed: int, batch: int, seq: int, vocab: int, eos: int | None = None):
        self.path = Path(path)
        self.eos = eos
        self.seed, self.batch, self.seq = seed, batch, seq
        dtype = self._dtype_from_meta(vocab)
        if not self.path.is_file():
            raise _refuse(f"token file not found: {path}",
                          "make one with `python examples/prepare_corpus.py -o data` and pass --data data/train.bin")
        size = self.path.stat().st_size
        itemsize = np.dtype(dtype).itemsize
        if size % itemsize:
            raise _refuse(f"{path}: {size} bytes is not a whole number of {np.dtype(dtype).name} tokens "
                          "(truncated or of another dtype)",
                          "re-create the file with examples/prepare_corpus.py, or fix dtype in meta.json")
        # an empty file cannot be mapped; it holds no sequence either
        self.tokens = np.memmap(self.path, dtype=dtype, mode="r") if size else np.zeros(0, dtype=dtype)
        if len(self.tokens) < seq + 2:
            raise _refuse(f"{path}: {len(self.tokens)} tokens, fewer than one sequence of {seq + 1}",
                          "use a larger corpus or a shorter --seq-len at compile time")
        probe = self.tokens[: min(len(self.tokens), 1 << 16)]
        if int(probe.max()) >= vocab:
            raise _refuse(f"{path}: token id {int(probe.max())} is outside the model's vocabulary of {vocab}",
                          "the file was made with another tokenizer, or read with the wrong dtype")
        self.starts = None if eos is None else self._document_starts(eos, vocab)

    def _document_starts(self, eos: int, vocab: int) -> np.ndarray:
        """The positions a row may start at: each document's first token that leaves a whole row
        after it. Refuses a separator outside the vocabulary, and a document longer than a row."""
        if not 0 <= eos < vocab:
            raise _refuse(f"--documents eos:{eos}: the separator id is outside the model's vocabulary of {vocab}",
                          f"give the corpus's end-of-document token, an id below {vocab}")
        ends = np.flatnonzero(self.tokens == eos) + 1
        if len(ends) == 0:
            raise _refuse(f"{self.path}: no separator (token {eos}) in {len(self.tokens)} tokens: the whole "
                          f"file is one document, longer than a row of {self.seq}",
                          "prepare the corpus with separators (examples/prepare_corpus.py --documents), or name "
                          "its separator id")
        starts = np.concatenate(([0], ends[:-1]))
        lengths = ends - starts
        long = np.flatnonzero(lengths > self.seq)
        if len(long):
            k = int(long[0])
            raise _refuse(f"{self.path}: document {k} (tokens {int(starts[k])}..{int(ends[k]) - 1}) has "
                          f"{int(lengths[k])} tokens, longer than a row of {self.seq}"
                          + (f" ({len(long)} such documents)" if len(long) > 1 else ""),
                          f"cut long documents to at most {self.seq} tokens when preparing the corpus, or "
                          "compile for a longer --seq-len")
        ok = np.concatenate(([0], ends))
        ok = ok[ok + self.seq + 1 <= len(self.tokens)]
        if len(ok) == 0:
            raise _refuse(f"{self.path}: no document starts a whole row of {self.seq + 1} tokens",
                          "use a larger corpus or a shorter --seq-len at compile time")
        return ok

    def _dtype_from_meta(self, vocab: int):
        meta_path = self.path.parent / "meta.json"
        if not meta_path.is_file():
            return np.uint16  # nanoGPT's convention
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError) as e:
            raise _refuse(f"{meta_path}: unreadable ({e})", "re-create it with examples/prepare_corpus.py")
        name = meta.get("dtype", "uint16")
        if name not in _DTYPES:
            raise _refuse(f"{meta_path}: unknown dtype {name!r}", f"use one of {', '.join(_DTYPES)}")
        if "vocab" in meta and int(meta["vocab"]) > vocab:
            raise _refuse(f"{meta_path}: the corpus has a vocabulary of {meta['vocab']}, the model {vocab}",
                          "compile a model whose vocabulary covers the corpus")
        return _DTYPES[name]

    def _offsets(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step])
        if self.starts is not None:  # packed documents: each row starts at a document
            return self.starts[rng.integers(0, len(self.starts), size=self.batch)]
        return rng.integers(0, len(self.tokens) - self.seq - 1, size=self.batch)

    def rows(self, step: int, lo: int, hi: int) -> torch.Tensor:
        starts = self._offsets(step)[lo:hi]
        out = np.stack([np.asarray(self.tokens[s : s + self.seq + 1], dtype=np.int64) for s in starts])
        return torch.from_numpy(out)

    def get(self, step: int) -> torch.Tensor:
        return self.rows(step, 0, self.batch)


@dataclass(frozen=True)
class DocumentProfile:
    """A token file's documents: how many, their mean and longest length (separator counted)."""

    count: int
    mean: float
    longest: int


def document_profile(path: str, eos: int) -> DocumentProfile:
    """The documents of token file `path`, ended by separator `eos` (its dtype from meta.json)."""
    from tpc.executors.training.documents import document_lengths

    reader = TokenFileBatches.__new__(TokenFileBatches)
    reader.path = Path(path)
    if not reader.path.is_file():
        raise _refuse(f"token file not found: {path}", "give the token file of the corpus (examples/prepare_corpus.py)")
    dtype = reader._dtype_from_meta(1 << 62)
    size = reader.path.stat().st_size
    tokens = np.memmap(reader.path, dtype=dtype, mode="r") if size else np.zeros(0, dtype=dtype)
    lengths = document_lengths(np.asarray(tokens), eos)
    if len(lengths) == 0:
        raise _refuse(f"{path}: no tokens", "give the token file of the corpus")
    return DocumentProfile(len(lengths), float(lengths.mean()), int(lengths.max()))
