"""The trace format: one Chrome-trace JSON schema for the predicted timeline (`tpc simulate
--trace`, built by `timeline.predicted_trace`) and the measured one (`tpc run --trace`, built by
`tpc.executors.engine.measured_trace`), its one writer and its one reader.

The trace format
================

One JSON object in the Chrome trace-event format, which Perfetto (ui.perfetto.dev) and
chrome://tracing open::

    {"traceEvents": [...], "displayTimeUnit": "ms",
     "otherData": {"tpc": {"plan": "plan.tpir", "schedule": "terapipe", "source": "simulate",
                           "time_unit": "s", "us_per_unit": 1000000.0}}}

`otherData.tpc.source` is "simulate" (predicted) or "run" (measured); `time_unit` is the unit the
times were taken in ("s", or a cost model's abstract "unit") and `us_per_unit` how many
microseconds one of it is written as. `plan` and `schedule` are "" where the writer does not
know them (a measured trace).

`traceEvents` holds, in this order:

* per rank r, two metadata events naming and ordering its process:
  `{"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": "rank r"}}` and
  `{"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}}`;
* per instruction, one complete event:
  `{"ph": "X", "name": "forward stage 1 mb 0 slice 3", "cat": "forward", "pid": r, "tid": 0,
  "ts": T, "dur": D, "args": {"rank": r, "index": i, "line": L,
  "instr": "forward stage 1 mb 0 slice 3", "step": s}}`.
  `ts` and `dur` are microseconds from the start of the trace. `pid` (= `args.rank`) is the
  rank that ran the instruction: data replica d's pipeline rank p is rank d * pipe + p, so a
  prediction (which simulates replica 0) has the pipeline ranks. `name` and `args.instr` are the
  instruction as the plan writes it, `cat` its op. `args.index` is its position in the rank's
  stream (null in a measured trace), `args.line` its line in the .tpir file (null for a plan
  built in memory), `args.step` the training step (0 in a prediction; a measured trace of
  several steps repeats every instruction once per step). A receive's `dur` includes its
  waiting;
* per message, in a prediction, a flow arrow from the send to its receive: `{"ph": "s", "id": k,
  "cat": "p2p", "name": "act", "pid": src, "tid": 0, "ts": <send's ts>}` and `{"ph": "f", "bp":
  "e", "id": k, "cat": "p2p", "name": "act", "pid": dst, "tid": 0, "ts": <data there>}` (a
  receive that waited ends when its message arrives). A measured trace has none: the engine
  records an instruction's text and times, not which send a receive matched.

The file holds one event per line. A reader (`read_trace`, used by `tpc simulate --compare`)
needs only the "X" events with `args.rank`, `args.instr` and `ts`/`dur`; everything else is for
people.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from tpc.ir.diagnostics import Diagnostic, TpirError
from tpc.ir.files import atomic_writer


@dataclass(frozen=True)
class TimedInstr:
    """One instruction of a trace (an "X" event), its times in microseconds."""

    rank: int
    instr: str  # as the plan writes it
    ts: float
    dur: float
    step: int = 0
    line: int | None = None
    index: int | None = None  # in the rank's stream; None where not known (measured)

    @property
    def op(self) -> str:
        return self.instr.split(" ", 1)[0]


@dataclass(frozen=True)
class Flow:
    """One message: sent by `src` at `ts`, there on `dst` at `there` (microseconds)."""

    payload: str
    src: int
    ts: float
    dst: int
    there: float


def trace_document(instrs: Iterable[TimedInstr], *, ranks: Iterable[int], source: str,
                   time_unit: str = "s", us_per_unit: float = 1e6, flows: Iterable[Flow] = (),
                   plan: str = "", schedule: str = "") -> dict:
    """The trace (module docstring) of `instrs` on `ranks`, with `flows` as arrows."""
    events: list[dict] = []
    for r in sorted(ranks):
        events.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0,
                       "args": {"name": f"rank {r}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0,
                       "args": {"sort_index": r}})
    for t in instrs:
        events.append({
            "ph": "X", "name": t.instr, "cat": t.op, "pid": t.rank, "tid": 0, "ts": t.ts, "dur": t.dur,
            "args": {"rank": t.rank, "index": t.index, "line": t.line, "instr": t.instr, "step": t.step},
        })
    for k, f in enumerate(flows):
        common = {"id": k, "cat": "p2p", "name": f.payload, "tid": 0}
        events.append({"ph": "s", "pid": f.src, "ts": f.ts, **common})
        events.append({"ph": "f", "bp": "e", "pid": f.dst, "ts": f.there, **common})
    meta = {"plan": plan, "schedule": schedule, "source": source, "time_unit": time_unit,
            "us_per_unit": us_per_unit}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"tpc": meta}}


def write_trace_file(path: str | Path, document: dict) -> None:
    """`document` as JSON, one event per line, all or nothing (tpc.ir.files)."""
    rest = {k: v for k, v in document.items() if k != "traceEvents"}
    with atomic_writer(path, "w") as f:
        f.write('{"traceEvents": [\n')
        f.write(",\n".join(json.dumps(e) for e in document["traceEvents"]))
        f.write("\n],\n")
        f.write(",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in rest.items()))
        f.write("\n}\n")


def _bad_trace(path: str, what: str) -> TpirError:
    return TpirError(Diagnostic(
        f"{what}", where=path,
        hint="give a trace written by `tpc run --trace` or `tpc simulate --trace` (the format is "
        "described in tpc/compiler/predict/chrome_trace.py)",
    ))


def read_trace(path: str) -> list[TimedInstr]:
    """The instruction events of a trace file; a located TpirError when it is not one."""
    p = Path(path)
    if not p.is_file():
        raise _bad_trace(path, f"no such file: {path}")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _bad_trace(path, f"not JSON: {e}") from None
    raw = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(raw, list):
        raise _bad_trace(path, "no \"traceEvents\" list")
    out = []
    for n, ev in enumerate(raw):
        if not isinstance(ev, dict) or ev.get("ph") != "X":
            continue
        args = ev.get("args") or {}
        try:
            out.append(TimedInstr(
                rank=int(args["rank"]), instr=str(args["instr"]), ts=float(ev["ts"]),
                dur=float(ev["dur"]), step=int(args.get("step") or 0),
                line=None if args.get("line") is None else int(args["line"]),
                index=None if args.get("index") is None else int(args["index"]),
            ))
        except (KeyError, TypeError, ValueError):
            raise _bad_trace(
                path, f"event {n} (\"X\") lacks a number in ts/dur or args.rank/args.instr"
            ) from None
    if not out:
        raise _bad_trace(path, "no \"X\" events with args.rank and args.instr")
    return out
