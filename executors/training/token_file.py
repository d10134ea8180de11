"""Batches from a token file (`examples/prepare_corpus.py` writes one): a flat array of token ids,
read through numpy.memmap, so a rank touches only the rows it needs.

Sampling is deterministic in (seed, step): row r of step s starts at an offset drawn from a
generator seeded with (seed, s), the same on every rank, so ranks agree on the batch without
talking, and a resumed run sees the same data order as one never stopped.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from tpc.ir.diagnostics import Diagnostic, TpirError

_DTYPES = {"uint16": np.uint16, "uint32": np.uint32, "int32": np.int32, "int64": np.int64}


def _refuse(message: str, hint: str) -> TpirError:
    return TpirError(Diagnostic(message, hint=hint))


class TokenFileBatches:
    """`get(step) -> (batch, seq+1)` int64 tokens; `rows(step, lo, hi)` reads only rows [lo, hi)."""

    def __init__(self, path: str, *, seed: int, batch: int, seq: int, vocab: int):
        self.path = Path(path)
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
        return rng.integers(0, len(self.tokens) - self.seq - 1, size=self.batch)

    def rows(self, step: int, lo: int, hi: int) -> torch.Tensor:
        starts = self._offsets(step)[lo:hi]
        out = np.stack([np.asarray(self.tokens[s : s + self.seq + 1], dtype=np.int64) for s in starts])
        return torch.from_numpy(out)

    def get(self, step: int) -> torch.Tensor:
        return self.rows(step, 0, self.batch)
