"""The validation batches of `tpc run --eval-data FILE --eval-batches K`: the same K batches at
every evaluation, read from a token file (`examples/prepare_corpus.py` writes val.bin).

Batch k is rows k·B .. (k+1)·B - 1 of K·B windows of seq+1 tokens spread evenly over the file,
none overlapping another (window j starts at j·stride, stride = (N - seq - 1) // (K·B - 1)), so
the K batches cover the whole file and an evaluation sees no token twice. A file is refused before
any training, with what would be right: one too short for K·B windows of seq tokens, one whose
tokens (every token the K batches read is checked) lie outside the model's vocabulary, one whose
meta.json names another vocabulary or tokenizer than the training data's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tpc.executors.training.token_file import TokenFileBatches
from tpc.ir.diagnostics import Diagnostic, TpirError


def _refuse(message: str, hint: str) -> TpirError:
    return TpirError(Diagnostic(message, where="--eval-data", hint=hint))


class EvalBatches(TokenFileBatches):
    """`get(k) -> (batch, seq+1)` int64 tokens of validation batch k, for k < `count`."""

    def __init__(self, path: str, *, batch: int, seq: int, vocab: int, count: int,
                 train_data: str | None = None):
        if not Path(path).is_file():
            raise _refuse(f"validation token file not found: {path}",
                          "make one with `python examples/prepare_corpus.py -o data` and pass "
                          "--eval-data data/val.bin")
        _check_same_corpus(path, train_data)
        try:
            super().__init__(path, seed=0, batch=batch, seq=seq, vocab=vocab)
        except TpirError as e:
            d = e.diagnostics[0]
            raise _refuse(f"validation data: {d.message}", d.hint) from None
        self.count = count
        rows = count * batch
        n = len(self.tokens)
        need = rows * seq + 1
        if n < need:
            most = (n - 1) // (batch * seq)
            raise _refuse(
                f"{path}: {n} tokens, too few for --eval-batches {count} of {batch} rows x "
                f"{seq + 1} tokens without overlap (that needs {need})",
                f"use --eval-batches {most}" if most >= 1 else
                "use a larger validation file (examples/prepare_corpus.py --val-fraction)")
        self.stride = (n - seq - 1) // (rows - 1) if rows > 1 else 0
        used = np.concatenate([np.asarray(self.tokens[s: s + seq + 1]) for s in self._starts()])
        top = int(used.max())
        if top >= vocab:
            where = int(np.argmax(used >= vocab))
            raise _refuse(f"{path}: token id {top} is outside the model's vocabulary of {vocab} "
                          f"(first at token {where} of the validation windows)",
                          "the file was made with another tokenizer than the training data, "
                          "or is read with the wrong dtype (meta.json)")

    def _starts(self) -> np.ndarray:
        return np.arange(self.count * self.batch, dtype=np.int64) * self.stride

    def _offsets(self, step: int) -> np.ndarray:
        if not 0 <= step < self.count:
            raise IndexError(f"validation batch {step} of {self.count}")
        return self._starts()[step * self.batch: (step + 1) * self.batch]


def _meta(path: str) -> dict | None:
    meta = Path(path).parent / "meta.json"
    try:
        return json.loads(meta.read_text()) if meta.is_file() else None
    except (OSError, ValueError):
        return None  # the token-file reader reports an unreadable meta.json


def _check_same_corpus(path: str, train_data: str | None) -> None:
    """The validation file is tokenized like the training data: the same vocabulary and
    tokenizer where both files have a meta.json."""
    if train_data is None:
        return
    mine, theirs = _meta(path), _meta(train_data)
    if not mine or not theirs:
        return
    for key in ("vocab", "tokenizer", "dtype"):
        if key in mine and key in theirs and mine[key] != theirs[key]:
            raise _refuse(
                f"{path}: its meta.json says {key} {mine[key]!r}, the training data's ({train_data}) "
                f"{theirs[key]!r}", "validate on a file made like the training data (the val.bin "
                "examples/prepare_corpus.py writes beside train.bin)")
