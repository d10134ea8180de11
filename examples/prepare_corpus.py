"""Make a token file from a real text corpus that every machine has: the Python standard library's
own source files. No download.

    python examples/prepare_corpus.py -o data/            # data/train.bin, data/val.bin, data/meta.json

Tokens are bytes (vocabulary 256: no tokenizer to train, every file encodes), stored as a flat
array of uint16 ids (nanoGPT's `.bin` convention, read with numpy.memmap). `meta.json` beside
the files records the dtype, the vocabulary and the token counts, so a reader can refuse a file
that does not match (see tpc.executors.training.token_file).

    python examples/prepare_corpus.py -o data/ --documents --max-document 2048

makes a corpus of packed documents instead: each source file is a document ended by the
separator token 0 (the NUL byte, which no source file holds; any is dropped), and a file longer
than --max-document tokens is cut into documents of at most that many (separator included), so
that every document fits a row (`tpc run --documents eos:0` refuses a longer one). `meta.json`
records the separator (`"eos": 0`) and the documents' count and mean length, the profile
`tpc compile --documents eos:0 --document-length N` prices attention by.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np

DTYPE = "uint16"
VOCAB = 256
SEPARATOR = b"\n\n"
EOS = 0  # the documents' separator (--documents): the NUL byte, which source text does not hold


def stdlib_sources(limit_bytes: int) -> tuple[bytes, int]:
    """The standard library's .py files in sorted path order (deterministic), up to limit_bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total, files = [], 0, 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue  # third-party code and the huge test suite are not "the standard library"
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data + SEPARATOR)
        total += len(data) + len(SEPARATOR)
        files += 1
        if total >= limit_bytes:
            break
    return b"".join(chunks)[:limit_bytes], files


def documents_of(corpus_files: list[bytes], max_document: int) -> bytes:
    """Each file a document ended by EOS (its NUL bytes dropped), cut into documents of at most
    `max_document` tokens, separator included."""
    out = []
    piece = max_document - 1
    for data in corpus_files:
        data = data.replace(bytes([EOS]), b"")
        for lo in range(0, max(len(data), 1), piece):
            out.append(data[lo:lo + piece] + bytes([EOS]))
    return b"".join(out)


def stdlib_files(limit_bytes: int) -> list[bytes]:
    """The standard library's .py files as `stdlib_sources` reads them, one bytes each."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        out.append(data)
        total += len(data) + 1
        if total >= limit_bytes:
            break
    return out


def write_split(out_dir: Path, corpus: bytes, val_fraction: float, documents: bool = False) -> dict:
    ids = np.frombuffer(corpus, dtype=np.uint8).astype(DTYPE)
    n_val = int(len(ids) * val_fraction)
    cut = len(ids) - n_val
    if documents:  # the split falls after a separator: both files hold whole documents
        ends = np.flatnonzero(ids == EOS) + 1
        cut = int(ends[np.searchsorted(ends, cut)]) if len(ends) and cut < ends[-1] else len(ids)
    train, val = ids[:cut], ids[cut:]
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, arr in (("train", train), ("val", val)):
        tmp = out_dir / f".{name}.bin.tmp"
        arr.tofile(tmp)
        tmp.replace(out_dir / f"{name}.bin")  # atomic: a reader never sees half a file
    meta = {"dtype": DTYPE, "vocab": VOCAB, "tokenizer": "bytes",
            "train_tokens": int(len(train)), "val_tokens": int(len(val))}
    if documents:
        count = int((train == EOS).sum())
        meta.update(eos=EOS, train_documents=count, mean_document=round(len(train) / max(count, 1), 1))
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-o", "--output", default="data", help="output directory (default: data)")
    p.add_argument("--max-bytes", type=int, default=8_000_000, help="corpus size in bytes = tokens (default: 8e6)")
    p.add_argument("--val-fraction", type=float, default=0.05, help="share kept for validation (default: 0.05)")
    p.add_argument("--documents", action="store_true",
                   help=f"packed documents: each file a document ended by token {EOS} (run with --documents eos:{EOS})")
    p.add_argument("--max-document", type=int, default=2048,
                   help="with --documents: cut longer files into documents of at most this many tokens (default: 2048)")
    args = p.parse_args(argv)
    if args.documents:
        if args.max_document < 2:
            print("prepare_corpus: --max-document must be at least 2 (a token and its separator)", file=sys.stderr)
            return 1
        parts = stdlib_files(args.max_bytes)
        corpus, files = documents_of(parts, args.max_document)[: args.max_bytes], len(parts)
        corpus = corpus[: corpus.rfind(bytes([EOS])) + 1]  # end on a whole document
    else:
        corpus, files = stdlib_sources(args.max_bytes)
    if not corpus:
        print("prepare_corpus: found no standard-library sources to read", file=sys.stderr)
        return 1
    meta = write_split(Path(args.output), corpus, args.val_fraction, args.documents)
    docs = (f", {meta['train_documents']:,} train documents of mean length {meta['mean_document']} "
            f"(separator {EOS})" if args.documents else "")
    print(f"prepare_corpus: {files} files -> {meta['train_tokens']:,} train + {meta['val_tokens']:,} val "
          f"byte tokens in {args.output}/ (train.bin, val.bin, meta.json){docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
