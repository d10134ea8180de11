"""Which CSV cell each instruction of an imported plan comes from, and the verifier's errors
said in those cells.

While a plan made from a torch schedule is verified, each instruction carries a location whose
line is a number of its own (`Cells.loc`), so that every place the verifier names, at the start
of a diagnostic or inside its message ("runs before line 17 (forward stage 0 mb 1 slice 0)"),
identifies one instruction. `Cells.relocate` then says each of them as the cell it came from:

    sched.csv:2:13: error: backward stage 1 mb 0 slice 0 runs before cell 2:9 `1F0` (forward ...)

An instruction tpc adds for an action (the receive before a computation, the send after it,
loads, free-kv, the optimizer step) is said at that action's cell, and named as added.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from tpc.compiler.torch_schedule.actions import Action
from tpc.ir.diagnostics import Diagnostic
from tpc.ir.nodes import COMPUTE_OPS, Instr, Loc, Plan

_LINE = re.compile(r"\bline (\d+)")
_INSTR = re.compile(r"`(forward|backward-input|backward-weight|backward|send act|send grad|recv act|recv grad) "
                    r"stage (\d+) mb (\d+) slice (\d+)(?: (?:to|from) \d+)?`")
_TORCH_KIND = {"forward": "F", "backward": "B", "backward-input": "I", "backward-weight": "W",
               "send act": "SEND_F", "send grad": "SEND_B", "recv act": "RECV_F", "recv grad": "RECV_B"}


@dataclass(frozen=True)
class Origin:
    """Where an instruction comes from: the action of a cell (`implied`: an instruction tpc
    adds for that action), or, with no action, the row of a rank that has none."""

    action: Action | None
    rank: int
    implied: bool = False

    def loc(self, path: str) -> Loc:
        return self.action.loc if self.action is not None else Loc(path, self.rank + 1, 1)

    def cell(self) -> str:
        if self.action is None:
            return f"line {self.rank + 1} (rank {self.rank})"
        a = self.action
        text = f"`{a}` in `{a.overlap}`" if a.overlap else f"`{a}`"
        return f"cell {a.loc.line}:{a.loc.col} {text}"


class Cells:
    """Numbers the instructions of a plan being verified and maps them back to their cells."""

    def __init__(self, path: str, units=()):
        self.path = path
        self._by_id: dict[int, tuple[Origin, Instr | None]] = {}
        self._torch_mb = {unit: k for k, unit in enumerate(units)}  # (mb, slice) -> torch index

    def loc(self, origin: Origin, instr: Instr | None) -> Loc:
        """A location of its own for `instr` (None: the rank's section line)."""
        n = len(self._by_id) + 1
        self._by_id[n] = (origin, instr)
        return Loc(self.path, n, 1)

    def relocate(self, diag: Diagnostic) -> Diagnostic:
        """`diag` at the cell of the instruction it is about, every place it names said as a cell."""
        loc, message = diag.loc, diag.message
        if loc is not None and loc.line in self._by_id:
            origin, instr = self._by_id[loc.line]
            loc = origin.loc(self.path)
            if origin.implied and instr is not None:
                message += f" [`{instr}` is what tpc adds for {origin.cell()}]"
        return dataclasses.replace(diag, loc=loc, message=self._say(message),
                                   hint=self._torch_words(self._say(diag.hint)))

    def _torch_words(self, text: str) -> str:
        """Each instruction a hint asks for, followed by the torch action that says it."""

        def say(m: re.Match) -> str:
            what, s, mb, i = m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))
            k = self._torch_mb.get((mb, i))
            return m.group(0) if k is None else f"{m.group(0)} (torch `{s}{_TORCH_KIND[what]}{k}`)"

        return _INSTR.sub(say, text)

    def _say(self, text: str) -> str:
        out, pos = [], 0
        for m in _LINE.finditer(text):
            n = int(m.group(1))
            if n not in self._by_id or m.start() < pos:
                continue
            origin, instr = self._by_id[n]
            end = m.end()
            named = f" ({instr})" if instr is not None else None
            if named and text.startswith(named, end):
                end += len(named)
                said = (f"the `{instr}` tpc adds for {origin.cell()}" if origin.implied
                        else f"{origin.cell()} ({instr})")
            else:
                said = origin.cell()
            out += [text[pos:m.start()], said]
            pos = end
        return ("".join(out) + text[pos:]).replace("this line", "this action")

    def at_cells(self, plan: Plan) -> Plan:
        """`plan` with every instruction's location the cell it comes from (for the executors'
        and the simulator's messages) and, on each computation, a note naming the action."""
        ranks = []
        for rp in plan.ranks:
            instrs = []
            for ins in rp.instrs:
                origin, _ = self._by_id[ins.loc.line]
                note = None
                if not origin.implied and origin.action is not None and ins.op in COMPUTE_OPS:
                    a = origin.action
                    note = f"torch {a}" + (f" in {a.overlap}" if a.overlap else "") + f" at {a.loc.line}:{a.loc.col}"
                instrs.append(ins.with_trivia(loc=origin.loc(self.path), note=note))
            ranks.append(dataclasses.replace(rp, instrs=tuple(instrs), loc=Loc(self.path, rp.rank + 1, 1)))
        return dataclasses.replace(plan, ranks=tuple(ranks))
