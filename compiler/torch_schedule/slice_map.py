"""Token slices as torch micro-batches: the map between a torch index and a (micro-batch, slice).

torch's schedule IR has no token-slice field: an action names a stage and a micro-batch index.
A tpc plan's unit of work is a (micro-batch, token slice). Both directions use one flattening,
in forward order: torch index k is the k-th (micro-batch, slice) when micro-batches are taken in
order and each one's slices in token order. With one slice per micro-batch it is the identity.

`tpc export-schedule` writes the map beside the CSV (`SCHED.csv.map.json`): which rows and
tokens each torch index stands for. Reading a CSV back (`tpc verify`, `tpc simulate`, `tpc
compile --schedule-file`), tpc uses that map when it is there, so the token slices, and the
dependencies between them (the KV cache forward, reverse token order backward), come back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Header, Microbatch

FORMAT = "tpc torch-schedule slice map 1"


def map_path(csv_path: str) -> str:
    """Where the map of `csv_path` lives: beside it, `.map.json` appended."""
    return str(csv_path) + ".map.json"


@dataclass(frozen=True)
class SliceMap:
    seq: int
    data: int
    # per tpc micro-batch: (rows of a replica's batch, token slices)
    microbatches: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]
    # torch index -> (tpc micro-batch, slice)
    units: tuple[tuple[int, int], ...]

    @staticmethod
    def of_header(header: Header) -> "SliceMap":
        mbs = tuple((m.size, tuple(m.slices)) for m in header.microbatches)
        return SliceMap(seq=header.shape.seq, data=header.mesh.data, microbatches=mbs,
                        units=flat_units(header))

    def header_microbatches(self) -> tuple[Microbatch, ...]:
        return tuple(Microbatch(index=m, size=size, slices=slices)
                     for m, (size, slices) in enumerate(self.microbatches))

    def to_json(self, **extra) -> dict:
        rows, start = [], 0
        for size, _ in self.microbatches:
            rows.append((start, start + size))
            start += size
        return {
            "format": FORMAT,
            "about": "torch micro-batch k of the CSV is token slice `slice` of tpc micro-batch `mb`: "
                     "rows [rows[0], rows[1]) of each data-parallel replica's batch, tokens "
                     "[tokens[0], tokens[1])",
            "seq": self.seq,
            "data": self.data,
            "microbatches": [{"mb": m, "rows": list(rows[m]), "slices": [list(s) for s in slices]}
                             for m, (_, slices) in enumerate(self.microbatches)],
            "torch_microbatches": [{"torch": k, "mb": m, "slice": i, "rows": list(rows[m]),
                                    "tokens": list(self.microbatches[m][1][i])}
                                   for k, (m, i) in enumerate(self.units)],
            **extra,
        }


def flat_units(header: Header) -> tuple[tuple[int, int], ...]:
    """Every (micro-batch, slice) of `header` in forward order: torch index k is the k-th."""
    return tuple((m, i) for m, mb in enumerate(header.microbatches) for i in range(len(mb.slices)))


def find_map(csv_path: str) -> SliceMap | None:
    """The map beside `csv_path`, or None when there is none."""
    path = map_path(csv_path)
    return read_map(path) if Path(path).is_file() else None


def read_map(path: str) -> SliceMap:
    """Read a map written by `tpc export-schedule`; anything malformed is a TpirError."""

    def bad(what: str) -> TpirError:
        return TpirError(Diagnostic(f"{path}: {what}", where=path,
                                    hint="rewrite it with `tpc export-schedule PLAN -o SCHED.csv`, "
                                         "or delete it to read the CSV with one slice per micro-batch"))

    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"not a readable JSON slice map ({e})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise bad(f"not a slice map (its \"format\" is not {FORMAT!r})")
    try:
        seq, data = int(raw["seq"]), int(raw["data"])
        mbs = []
        for m, entry in enumerate(raw["microbatches"]):
            lo, hi = (int(x) for x in entry["rows"])
            slices = tuple((int(a), int(b)) for a, b in entry["slices"])
            if int(entry["mb"]) != m or hi <= lo or not slices:
                raise ValueError(f"micro-batch entry {m}")
            mbs.append((hi - lo, slices))
        units = []
        for k, entry in enumerate(raw["torch_microbatches"]):
            if int(entry["torch"]) != k:
                raise ValueError(f"torch micro-batch entry {k} is numbered {entry['torch']}")
            m, i = int(entry["mb"]), int(entry["slice"])
            if not (0 <= m < len(mbs) and 0 <= i < len(mbs[m][1])):
                raise ValueError(f"torch micro-batch {k} names a slice that does not exist")
            units.append((m, i))
    except (KeyError, TypeError, ValueError) as e:
        raise bad(f"malformed entry ({e})") from None
    if sorted(units) != sorted((m, i) for m, (_, s) in enumerate(mbs) for i in range(len(s))) or len(set(units)) != len(units):
        raise bad("its torch micro-batches do not name every slice exactly once")
    return SliceMap(seq=seq, data=data, microbatches=tuple(mbs), units=tuple(units))
