"""torch.distributed.pipelining's schedule CSV: its actions, and the cell each was written in.

torch writes a schedule (`_dump_csv`) with `csv.writer`, one row per pipeline rank, one cell per
action, an empty cell for an idle step; it reads one back (`_load_csv`) with `csv.reader` and
`_Action.from_str`. An action is written `[stage][type][micro-batch]`:

    2F0        forward of stage 2, micro-batch 0
    1B3        full backward;  1I3 backward-input;  1W3 backward-weight
    0SEND_F1   send stage 0's output of micro-batch 1;  1RECV_F1 receive stage 1's input
    1SEND_B1   send the gradient of stage 1's input;    0RECV_B1 receive the gradient of stage 0's output
    0UNSHARD   FSDP: gather stage 0's parameters;  0RESHARD free them;  0REDUCE_GRAD reduce its gradients
    (0F3;3B1)OVERLAP_F_B   two computations torch's runtime runs one after the other

This module reads that text strictly: every cell is one action (or empty), each action knows its
`file:line:col` (the line is the rank's row, the column the cell's first character; a
sub-action of an OVERLAP_F_B cell points at its own characters), and every cell that is not an
action is reported at once, located. torch's own reader accepts a cell whose beginning is an
action and ignores the rest; this one does not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tpc.ir.diagnostics import Diagnostic, TpirError, quote
from tpc.ir.nodes import Loc

# the computation types, as torch's _ComputationType spells them
FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = "F", "B", "I", "W"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
UNSHARD, RESHARD, REDUCE_GRAD = "UNSHARD", "RESHARD", "REDUCE_GRAD"
OVERLAP_F_B = "OVERLAP_F_B"

COMPUTE = (FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
COMMS = (SEND_F, RECV_F, SEND_B, RECV_B)
STAGE_WIDE = (UNSHARD, RESHARD, REDUCE_GRAD)  # about a whole stage: no micro-batch

_ACTION = re.compile(r"(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)")
_FORM = ("[stage][F|B|I|W|SEND_F|RECV_F|SEND_B|RECV_B][micro-batch] (e.g. 2F0, 0SEND_F1), "
         "[stage][UNSHARD|RESHARD|REDUCE_GRAD] (e.g. 1UNSHARD), or (A;B)OVERLAP_F_B of two computations")


@dataclass(frozen=True)
class Action:
    """One action of a rank's row. An OVERLAP_F_B cell gives one Action per sub-action, in
    order, each with `overlap` set to the whole cell's text."""

    stage: int
    kind: str
    mb: int | None
    loc: Loc
    rank: int  # the row
    column: int  # the cell's index in its row, from 0
    overlap: str | None = None

    def __str__(self) -> str:
        """As torch writes it: `2F0`, `1UNSHARD`."""
        return f"{self.stage}{self.kind}{'' if self.mb is None else self.mb}"

    @property
    def place(self) -> str:
        """'rank 1, action 4' (the row and the cell's index in it, both from 0)."""
        return f"rank {self.rank}, action {self.column}"


@dataclass(frozen=True)
class TorchCsv:
    """A schedule CSV read into actions: `rows[r]` is rank r's actions in order, idle cells
    left out and OVERLAP_F_B cells expanded into their sub-actions."""

    path: str
    text: str
    rows: tuple[tuple[Action, ...], ...]

    @property
    def actions(self):
        return (a for row in self.rows for a in row)

    @property
    def has_comms(self) -> bool:
        """The compute+comms form: the CSV places its own sends and receives."""
        return any(a.kind in COMMS for a in self.actions)


def is_schedule_csv(path: str) -> bool:
    """A torch schedule CSV is named *.csv; everything else is taken for a .tpir plan."""
    return Path(path).suffix.lower() == ".csv"


def read_csv(path: str) -> TorchCsv:
    """Read and parse the schedule CSV at `path` (TpirError for a missing file or bad cells)."""
    from tpc.ir.files import read_text

    return parse_csv(read_text(path, what="a schedule CSV written by torch's _dump_csv"), path)


def parse_csv(text: str, path: str = "<schedule.csv>") -> TorchCsv:
    """Parse the text of a schedule CSV; every malformed cell is one located diagnostic."""
    problems: list[Diagnostic] = []
    rows = []
    for rank, line in enumerate(_lines(text)):
        row: list[Action] = []
        for column, (cell, col) in enumerate(_cells(line, rank, path, problems)):
            loc = Loc(path, rank + 1, col)
            row += _parse_cell(cell, loc, rank, column, problems)
        rows.append(tuple(row))
    if not problems:
        problems += _beyond_the_file(rows)
    if problems:
        raise TpirError(problems, source=text)
    if not rows:
        raise TpirError(Diagnostic(f"{path} is empty", where=path,
                                   hint="a schedule CSV has one row of actions per pipeline rank"))
    return TorchCsv(path=path, text=text, rows=tuple(rows))


def _beyond_the_file(rows: list[tuple[Action, ...]]) -> list[Diagnostic]:
    """A stage or micro-batch number no schedule of this file's size could have: a schedule
    names stages 0..S-1 and micro-batches 0..M-1 and runs every one of them, so each index is
    below the number of actions. Refused here, located, before anything is sized by them (a
    stray `999999999F0` would otherwise make the plan that big)."""
    n = sum(len(r) for r in rows)
    out = []
    for action in (a for r in rows for a in r):
        for what, whats, value in (("stage", "stages", action.stage), ("micro-batch", "micro-batches", action.mb)):
            if value is not None and value >= n:
                out.append(Diagnostic(
                    f"{what} {value} is beyond any schedule this file could hold: it has {n} actions, "
                    f"and a schedule runs every {what} from 0 up, each in actions of its own",
                    loc=action.loc, hint=f"number the {whats} from 0 without gaps"))
    return out


def _lines(text: str) -> list[str]:
    """The rows as csv.reader sees them: one per line (a trailing newline ends the last row)."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [ln[:-1] if ln.endswith("\r") else ln for ln in lines]


def _cells(line: str, rank: int, path: str, problems: list) -> list[tuple[str, int]]:
    """(cell text, 1-based column of its first character) for each cell of one line; quoted
    cells ("...", with "" for a quote) as csv.reader reads them."""
    out: list[tuple[str, int]] = []
    i, n = 0, len(line)
    if n == 0:
        return out  # csv.reader reads an empty line as a row without cells
    while True:
        start = i
        if i < n and line[i] == '"':
            buf, i = [], i + 1
            while True:
                if i >= n:
                    problems.append(Diagnostic("unterminated quoted cell", loc=Loc(path, rank + 1, start + 1),
                                               hint="close the quote on the same line"))
                    return out
                if line[i] == '"':
                    if i + 1 < n and line[i + 1] == '"':
                        buf.append('"')
                        i += 2
                        continue
                    i += 1
                    break
                buf.append(line[i])
                i += 1
            while i < n and line[i] != ",":  # csv.reader keeps text after the closing quote
                buf.append(line[i])
                i += 1
            out.append(("".join(buf), start + 2))
        else:
            j = line.find(",", i)
            j = n if j < 0 else j
            out.append((line[i:j], start + 1))
            i = j
        if i >= n:
            return out
        i += 1  # the comma
        if i == n:
            out.append(("", i + 1))
            return out


def _parse_cell(cell: str, loc: Loc, rank: int, column: int, problems: list) -> list[Action]:
    """The actions of one cell (none for an empty one); problems are appended, located."""
    stripped = cell.strip()
    if not stripped:
        return []
    loc = Loc(loc.file, loc.line, loc.col + (len(cell) - len(cell.lstrip())))
    if stripped.startswith("("):
        return _parse_overlap(stripped, loc, rank, column, problems)
    action = _parse_action(stripped, loc, rank, column, problems)
    return [action] if action is not None else []


def _parse_action(text: str, loc: Loc, rank: int, column: int, problems: list,
                  overlap: str | None = None) -> Action | None:
    m = _ACTION.fullmatch(text)
    if m is None:
        problems.append(Diagnostic(f"`{quote(text)}` is not a torch pipelining action (rank {rank}, action {column})",
                                   loc=loc, hint=f"write {_FORM}"))
        return None
    stage, kind, mb = int(m.group(1)), m.group(2), m.group(3)
    if kind in STAGE_WIDE and mb:
        problems.append(Diagnostic(f"`{quote(text)}`: {kind} is about a whole stage and takes no micro-batch",
                                   loc=loc, hint=f"write `{stage}{kind}`"))
        return None
    if kind not in STAGE_WIDE and not mb:
        problems.append(Diagnostic(f"`{quote(text)}` names no micro-batch (rank {rank}, action {column})",
                                   loc=loc, hint=f"write the micro-batch index after {kind}, e.g. `{stage}{kind}0`"))
        return None
    return Action(stage, kind, int(mb) if mb else None, loc, rank, column, overlap)


def _parse_overlap(text: str, loc: Loc, rank: int, column: int, problems: list) -> list[Action]:
    close = text.find(")")
    if close < 0 or text[close + 1:] != OVERLAP_F_B:
        problems.append(Diagnostic(f"`{quote(text)}` is not a torch pipelining action (rank {rank}, action {column})",
                                   loc=loc, hint=f"write {_FORM}"))
        return []
    out: list[Action] = []
    offset = 1
    parts = text[1:close].split(";")
    for part in parts:
        lead = len(part) - len(part.lstrip())
        sub = part.strip()
        sub_loc = Loc(loc.file, loc.line, loc.col + offset + lead)
        offset += len(part) + 1
        if not sub:
            continue
        action = _parse_action(sub, sub_loc, rank, column, problems, overlap=text)
        if action is None:
            continue
        if action.kind not in COMPUTE:
            problems.append(Diagnostic(f"`{quote(sub)}` inside OVERLAP_F_B: only computations (F, B, I, W) overlap",
                                       loc=sub_loc, hint="move it into a cell of its own"))
            continue
        out.append(action)
    if not out and not any(p.loc and p.loc.line == loc.line for p in problems):
        problems.append(Diagnostic(f"`{quote(text)}` overlaps nothing", loc=loc,
                                   hint="list the computations it runs, e.g. (0F3;3B1)OVERLAP_F_B"))
    return out


def format_csv(rows: list[list[str]]) -> str:
    """Rows of action texts as torch's `_dump_csv` writes them (csv.writer: `,` and `\\r\\n`;
    no action needs quoting)."""
    return "".join(",".join(row) + "\r\n" for row in rows)
