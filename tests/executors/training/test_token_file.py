"""Token files: the corpus script makes one, the reader samples deterministically and refuses bad files."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from tpc.executors.training.token_file import TokenFileBatches
from tpc.ir.diagnostics import TpirError


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, repo_root):
    out = tmp_path_factory.mktemp("corpus")
    res = subprocess.run([sys.executable, str(repo_root / "examples" / "prepare_corpus.py"), "-o", str(out),
                          "--max-bytes", "200000"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return out


def test_corpus_is_byte_tokens_of_python_source(corpus):
    meta = json.loads((corpus / "meta.json").read_text())
    assert meta["vocab"] == 256 and meta["dtype"] == "uint16"
    train = np.memmap(corpus / "train.bin", dtype=np.uint16, mode="r")
    assert len(train) == meta["train_tokens"] and meta["train_tokens"] + meta["val_tokens"] == 200000
    text = bytes(train[:2000].astype(np.uint8)).decode("utf-8", errors="replace")
    assert "def " in text or "import " in text


def test_batches_are_deterministic_and_rows_are_a_slice_of_the_batch(corpus):
    a = TokenFileBatches(str(corpus / "train.bin"), seed=3, batch=4, seq=16, vocab=256)
    b = TokenFileBatches(str(corpus / "train.bin"), seed=3, batch=4, seq=16, vocab=256)
    assert a.get(7).shape == (4, 17) and a.get(7).dtype == torch.int64
    assert torch.equal(a.get(7), b.get(7))
    assert not torch.equal(a.get(7), a.get(8))
    assert torch.equal(a.rows(7, 1, 3), a.get(7)[1:3])


def test_truncated_file_is_refused(corpus, tmp_path):
    bad = tmp_path / "train.bin"
    bad.write_bytes((corpus / "train.bin").read_bytes()[:1001])  # odd byte count: not uint16
    with pytest.raises(TpirError, match="not a whole number of uint16 tokens"):
        TokenFileBatches(str(bad), seed=0, batch=2, seq=8, vocab=256)


def test_wrong_vocabulary_is_refused(corpus):
    with pytest.raises(TpirError, match="vocabulary"):
        TokenFileBatches(str(corpus / "train.bin"), seed=0, batch=2, seq=8, vocab=100)


def test_missing_file_says_how_to_make_one(tmp_path):
    with pytest.raises(TpirError) as e:
        TokenFileBatches(str(tmp_path / "none.bin"), seed=0, batch=2, seq=8, vocab=256)
    assert "prepare_corpus.py" in e.value.render()


def test_corpus_of_packed_documents_fits_rows(tmp_path, repo_root):
    """--documents: files ended by the separator 0, none longer than --max-document, rows that
    start at documents; the meta records the separator and the mean length."""
    out = tmp_path / "docs"
    res = subprocess.run([sys.executable, str(repo_root / "examples" / "prepare_corpus.py"), "-o", str(out),
                          "--max-bytes", "200000", "--documents", "--max-document", "64"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["eos"] == 0 and meta["train_documents"] > 1
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    ends = np.flatnonzero(train == 0) + 1
    assert ends[-1] == len(train) and np.diff(np.concatenate(([0], ends))).max() <= 64
    assert abs(meta["mean_document"] - len(train) / len(ends)) < 0.1
    batches = TokenFileBatches(str(out / "train.bin"), seed=0, batch=4, seq=64, vocab=256, eos=0)
    rows = batches.get(3)
    starts = set(np.concatenate(([0], ends)).tolist())
    assert set(batches._offsets(3).tolist()) <= starts and rows.shape == (4, 65)
