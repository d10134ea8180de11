"""Make a token file from a real text corpus that every machine has: the Python standard library's
own source files. No download.

    python examples/prepare_corpus.py -o data/            # data/train.bin, data/val.bin, data/meta.json

Tokens are bytes (vocabulary 256: no tokenizer to train, every file encodes), stored as a flat
array of uint16 ids (nanoGPT's `.bin` convention, read with numpy.memmap). `meta.json` beside
the files records the dtype, the vocabulary and the token counts, so a reader can refuse a file
that does not match (see tpc.executors.training.token_file).
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


def write_split(out_dir: Path, corpus: bytes, val_fraction: float) -> dict:
    ids = np.frombuffer(corpus, dtype=np.uint8).astype(DTYPE)
    n_val = int(len(ids) * val_fraction)
    train, val = ids[: len(ids) - n_val], ids[len(ids) - n_val :]
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, arr in (("train", train), ("val", val)):
        tmp = out_dir / f".{name}.bin.tmp"
        arr.tofile(tmp)
        tmp.replace(out_dir / f"{name}.bin")  # atomic: a reader never sees half a file
    meta = {"dtype": DTYPE, "vocab": VOCAB, "tokenizer": "bytes",
            "train_tokens": int(len(train)), "val_tokens": int(len(val))}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-o", "--output", default="data", help="output directory (default: data)")
    p.add_argument("--max-bytes", type=int, default=8_000_000, help="corpus size in bytes = tokens (default: 8e6)")
    p.add_argument("--val-fraction", type=float, default=0.05, help="share kept for validation (default: 0.05)")
    args = p.parse_args(argv)
    corpus, files = stdlib_sources(args.max_bytes)
    if not corpus:
        print("prepare_corpus: found no standard-library sources to read", file=sys.stderr)
        return 1
    meta = write_split(Path(args.output), corpus, args.val_fraction)
    print(f"prepare_corpus: {files} files -> {meta['train_tokens']:,} train + {meta['val_tokens']:,} val "
          f"byte tokens in {args.output}/ (train.bin, val.bin, meta.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
