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
import re
from dataclasses import dataclass
from pathlib import Path

from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.nodes import Header, Loc, Microbatch
from tpc.ir.verify.header import tiling_problems

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
    """Read a map written by `tpc export-schedule`; anything malformed is a TpirError at the
    entry it is in (`path:line:col` of the entry's `{`), saying what would be right."""
    rewrite = ("rewrite it with `tpc export-schedule PLAN -o SCHED.csv`, or delete it to read the CSV "
               "with one slice per micro-batch")

    def bad(what: str, loc: Loc | None = None, hint: str = rewrite) -> TpirError:
        return TpirError(Diagnostic(what, loc=loc, where=path if loc is None else "", hint=hint), source=text)

    text = ""
    try:
        text = Path(path).read_text(encoding="utf-8")
        raw = json.loads(text)
    except UnicodeDecodeError as e:
        raise bad(f"not a UTF-8 text file (byte {e.start} is {_byte(e)})") from None
    except json.JSONDecodeError as e:
        raise bad(f"not a readable JSON slice map ({e.msg})", Loc(path, e.lineno, e.colno)) from None
    except OSError as e:
        raise bad(f"cannot read it: {e.strerror or e}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise bad(f"not a slice map (its \"format\" is not {FORMAT!r})")
    try:
        seq, data = _count(raw, "seq"), _count(raw, "data")
        entries, units_raw = raw["microbatches"], raw["torch_microbatches"]
        if not isinstance(entries, list) or not isinstance(units_raw, list):
            raise ValueError("\"microbatches\" and \"torch_microbatches\" are lists")
    except (KeyError, TypeError, ValueError) as e:
        raise bad(f"malformed slice map ({_said(e)})") from None

    mbs, next_row = [], 0
    for m, entry in enumerate(entries):
        at = _entry_loc(text, path, "microbatches", m)
        try:
            lo, hi = (_int(x) for x in entry["rows"])
            slices = tuple((_int(a), _int(b)) for a, b in entry["slices"])
            numbered = _int(entry["mb"])
        except (KeyError, TypeError, ValueError) as e:
            raise bad(f"micro-batch entry {m} is malformed ({_said(e)})", at,
                      hint=f"write it as {{\"mb\": {m}, \"rows\": [A, B], \"slices\": [[0, T1], [T1, T2], ..., "
                           f"[Tn, {seq}]]}}") from None
        if numbered != m:
            raise bad(f"micro-batch entry {m} is numbered {numbered}", at, hint=f"write \"mb\": {m}")
        if lo != next_row or hi <= lo:
            what = (f"holds no row" if hi <= lo and lo == next_row
                    else f"do not start where the rows before it end, at {next_row}")
            size = hi - lo if hi > lo else 1
            raise bad(f"micro-batch {m}'s rows [{lo}, {hi}) {what}", at,
                      hint=f"micro-batches take consecutive rows of the batch, at least one each: write "
                           f"\"rows\": [{next_row}, {next_row + size}]")
        if not slices:
            raise bad(f"micro-batch {m} has no token slices", at, hint=f"write \"slices\": [[0, {seq}]]")
        negative = next((i for i, (a, b) in enumerate(slices) if a < 0 or b < 0), None)
        if negative is not None:
            a, b = slices[negative]
            raise bad(f"micro-batch {m}: slice {negative} [{a}, {b}] names a negative token", at,
                      hint=f"tokens are numbered 0..{seq - 1}: slices tile 0..{seq} in order, each [start, end) "
                           "with end > start")
        for kind, i, a, b, expect in tiling_problems(slices, seq):
            what = {"gap": f"tokens {expect}:{a} are in no slice (slice {i} is [{a}, {b}])",
                    "overlap": f"slice {i} [{a}, {b}] overlaps the slice before it, which ends at {expect}",
                    "empty": f"slice {i} [{a}, {b}] holds no token",
                    "end": f"its slices end at token {expect}, but the map's seq is {seq}"}[kind]
            fix = (f"slices tile the tokens 0..{seq} in order, each [start, end) with end > start: "
                   + (f"end the last slice at {seq}" if kind == "end" else
                      f"start slice {i} at token {expect}" if kind != "empty" else
                      f"end slice {i} after token {a}, or remove it"))
            raise bad(f"micro-batch {m}: {what}", at, hint=fix)
        mbs.append((hi - lo, slices))
        next_row = hi

    units = []
    for k, entry in enumerate(units_raw):
        at = _entry_loc(text, path, "torch_microbatches", k)
        try:
            numbered, m, i = _int(entry["torch"]), _int(entry["mb"]), _int(entry["slice"])
        except (KeyError, TypeError, ValueError) as e:
            raise bad(f"torch micro-batch entry {k} is malformed ({_said(e)})", at,
                      hint=f"write it as {{\"torch\": {k}, \"mb\": M, \"slice\": I, ...}}") from None
        if numbered != k:
            raise bad(f"torch micro-batch entry {k} is numbered {numbered}", at, hint=f"write \"torch\": {k}")
        if not (0 <= m < len(mbs) and 0 <= i < len(mbs[m][1])):
            raise bad(f"torch micro-batch {k} names slice {i} of micro-batch {m}, which does not exist", at,
                      hint=f"name one of micro-batches 0..{len(mbs) - 1} and one of its slices")
        tokens = entry.get("tokens")
        if tokens is not None and list(tokens) != list(mbs[m][1][i]):
            raise bad(f"torch micro-batch {k} says tokens {list(tokens)}, but slice {i} of micro-batch {m} is "
                      f"{list(mbs[m][1][i])}", at,
                      hint="the slices are read from \"microbatches\": edit them there, and make the "
                           f"tokens here say the same ({list(mbs[m][1][i])})")
        if (m, i) in units:
            raise bad(f"torch micro-batch {k} names slice {i} of micro-batch {m}, which torch micro-batch "
                      f"{units.index((m, i))} names too", at, hint="each slice is one torch micro-batch")
        units.append((m, i))
    missing = [(m, i) for m, (_, sl) in enumerate(mbs) for i in range(len(sl)) if (m, i) not in set(units)]
    if missing:
        m, i = missing[0]
        raise bad(f"no torch micro-batch names slice {i} of micro-batch {m}"
                  + (f" (nor {len(missing) - 1} other slices)" if len(missing) > 1 else ""),
                  _entry_loc(text, path, "microbatches", m), hint="each slice is one torch micro-batch: add "
                  "an entry for it to \"torch_microbatches\"")
    return SliceMap(seq=seq, data=data, microbatches=tuple(mbs), units=tuple(units))


def _int(x) -> int:
    """An integer of the map (a JSON integer; not a float, a string or a boolean)."""
    if isinstance(x, bool) or not isinstance(x, int):
        raise ValueError(f"{x!r} is not an integer"[:80])
    return x


def _count(raw: dict, key: str) -> int:
    value = _int(raw[key])
    if value < 1:
        raise ValueError(f"\"{key}\" is {value}, not a positive count")
    return value


def _said(e: Exception) -> str:
    return f"no \"{e.args[0]}\"" if isinstance(e, KeyError) else str(e)[:200]


def _byte(e: UnicodeDecodeError) -> str:
    return f"0x{e.object[e.start]:02x}"


def _entry_loc(text: str, path: str, key: str, index: int) -> Loc | None:
    """Where element `index` of the top-level list `key` starts in `text` (its first
    character); None where it cannot be found."""
    m = re.search(rf'"{key}"\s*:\s*\[', text)
    if m is None:
        return None
    decoder, pos = json.JSONDecoder(), m.end()
    try:
        for k in range(index + 1):
            while text[pos] in " \t\r\n,":
                pos += 1
            if k == index:
                break
            _, pos = decoder.raw_decode(text, pos)
    except (IndexError, ValueError):
        return None
    line = text.count("\n", 0, pos) + 1
    return Loc(path, line, pos - (text.rfind("\n", 0, pos) + 1) + 1)
