"""Communication rules across ranks (see tpc.ir.verify): F1 (FIFO channels), X1 (exchanges)
and D1 (no deadlock under the rules of the backend, tpc.ir.semantics)."""

from __future__ import annotations

from collections import defaultdict

from tpc.ir.nodes import Plan
from tpc.ir.semantics import (
    GLOO,
    CommRules,
    NCCL,
    comm_entries,
    exchange_span,
    message_key,
    run_comm,
    wait_chain,
)
from tpc.ir.verify.header import require_version
from tpc.ir.verify.report import O, Index, Report, Shape


# ------------------------------------------------------------------------------------ FIFO


def _channels(plan: Plan, idx: Index):
    """(src, dst) -> ([(position, message)] of sends on src, the same of receives on dst)."""
    chans: dict[tuple[int, int], tuple[list, list]] = defaultdict(lambda: ([], []))
    for r, rp in enumerate(plan.ranks):
        ok = idx.valid[r]
        for p, ins in enumerate(rp.instrs):
            if ok[p] and ins.op in (O.SEND, O.RECV):
                src, dst, msg = message_key(r, ins)
                chans[(src, dst)][ins.op is O.RECV].append((p, msg))
    return chans


def check_fifo(plan: Plan, shape: Shape, idx: Index, rep: Report) -> None:
    """F1: per channel, the receives take messages in the order they were sent."""
    for (src, dst), (sends, recvs) in sorted(_channels(plan, idx).items()):
        sent_at: dict[tuple, int] = {}
        for p, msg in sends:
            sent_at.setdefault(msg, p)
        top_send, top_recv = -1, -1
        for p, msg in recvs:
            sp = sent_at.get(msg)
            if sp is None:
                continue
            if sp < top_send:
                rep.instr(dst, p,
                          f"messages from rank {src} cross: this receive comes after "
                          f"{rep.ref(dst, top_recv)}, but rank {src} sends this one first: "
                          f"{rep.ref(src, sp)} before {rep.ref(src, top_send)}",
                          f"messages between two ranks arrive in the order they were sent: "
                          f"move this line above {rep.at(dst, top_recv)}, or swap the sends on "
                          f"rank {src}", comm=False)
                break
            top_send, top_recv = sp, p


# ------------------------------------------------------------------------------- exchanges


def check_exchanges(plan: Plan, rep: Report) -> None:
    """X1: `exchange N` (format version 2) is followed by N >= 2 sends and receives, the sends
    first, none of them another exchange."""
    for r, rp in enumerate(plan.ranks):
        instrs = rp.instrs
        for p, ins in enumerate(instrs):
            if ins.op is not O.EXCHANGE:
                continue
            require_version(plan, rep, 2, ins.loc, f"rank {r}, instruction {p} ({ins})", (1, r, p),
                            "`exchange`")
            n = ins.count
            span = exchange_span(instrs, p)
            members = [instrs[q] for q in span]
            hint = (f"write `exchange {n}` above {n} consecutive sends and receives, the sends "
                    "first; a lone send or receive needs no exchange")
            if n < 2:
                rep.instr(r, p, f"an exchange of {n} instruction{'s' if n != 1 else ''}: an "
                          "exchange groups at least 2 sends and receives", hint, comm=True)
            elif len(members) < n:
                rep.instr(r, p, f"`exchange {n}` needs {n} instructions below it, and the rank's "
                          f"stream ends after {len(members)}", hint, comm=True)
            elif not all(m.op in (O.SEND, O.RECV) for m in members):
                q = next(q for q in span if instrs[q].op not in (O.SEND, O.RECV))
                rep.instr(r, q, f"{instrs[q]} is inside the `exchange {n}` at {rep.at(r, p)}: "
                          "an exchange holds only sends and receives", hint, comm=True)
            elif any(a.op is O.RECV and b.op is O.SEND for a, b in zip(members, members[1:])):
                q = next(q for q in span[1:] if instrs[q].op is O.SEND and instrs[q - 1].op is O.RECV)
                rep.instr(r, q, f"a send after a receive inside the `exchange {n}` at "
                          f"{rep.at(r, p)}: an exchange lists its sends first", hint, comm=True)


# -------------------------------------------------------------------------------- deadlock


def check_deadlock(plan: Plan, shape: Shape, idx: Index, rep: Report, comm: CommRules) -> None:
    """D1: run every rank under `comm`'s rules (tpc.ir.semantics): a receive waits for its send,
    reduce-tied for its tie's ranks, and under NCCL a send or an exchange for its partners."""
    entries = [comm_entries(r, rp.instrs, keep=idx.valid[r].__getitem__)
               for r, rp in enumerate(plan.ranks)]
    ties = {t: ranks for t, ranks in shape.groups.items() if t in shape.ties or not isinstance(t, str)}
    # a plan that deadlocks even with buffered sends is reported as such: the order itself is
    # wrong, whatever the backend
    for rules in (GLOO,) if comm == GLOO else (GLOO, comm):
        stuck = run_comm(entries, ties, rules)
        if stuck:
            _report_deadlock(plan, idx, rep, stuck, rules)
            return


def _report_deadlock(plan, idx, rep, stuck, comm) -> None:
    waits_for = {r: b.waits_for for r, b in stuck.items()}
    blocked = {r: b.at for r, b in stuck.items()}
    send_at = _send_positions(plan, idx)
    rules = "" if comm == GLOO else " under NCCL's rules"
    for r, b in sorted(stuck.items()):
        chain = _wait_chain(r, waits_for, blocked, rep)
        ins = plan.ranks[r].instrs[b.at]
        if ins.op is O.RECV and comm == GLOO:
            src = ins.peer
            sp = send_at.get(message_key(r, ins)[2])
            message = (f"deadlock: rank {r} waits here forever for rank {src}, which never "
                       f"reaches its matching send")
            fix = ""
            if sp is not None and src in blocked:
                fix = (f"; the send at {rep.ref(src, sp)} must run before rank {src} blocks at "
                       f"{rep.at(src, blocked[src])}: move one of them, or this receive")
        elif ins.op in (O.SEND, O.RECV):
            peer = ins.peer
            what = "receive" if ins.op is O.SEND else "send"
            message = (f"deadlock{rules}: rank {r} waits here forever for rank {peer} to post "
                       f"the matching {what}")
            fix = ""
            if peer in blocked:
                fix = (f"; rank {peer} is itself blocked at {rep.ref(peer, blocked[peer])}. "
                       f"Under NCCL a send completes only when its receive is posted, and two "
                       f"ranks' sends and receives run in order on one FIFO: where two ranks each "
                       f"send before they receive, post each one's send and receive together as "
                       f"one `exchange N` (`tpc compile` does), or reorder them")
        else:
            others = ", ".join(str(q) for q in b.waits_for)
            message = (f"deadlock{rules}: rank {r} waits here forever for rank(s) {others} to "
                       f"reach {ins}")
            fix = "; reorder so that every rank of it reaches it without waiting on another"
        rep.instr(r, b.at, message, chain + fix)


def _send_positions(plan: Plan, idx: Index) -> dict[tuple, int]:
    out: dict[tuple, int] = {}
    for r, rp in enumerate(plan.ranks):
        for p, ins in enumerate(rp.instrs):
            if idx.valid[r][p] and ins.op is O.SEND:
                out.setdefault(message_key(r, ins)[2], p)
    return out


def _wait_chain(start: int, waits_for: dict[int, list[int]], blocked: dict[int, int],
                rep: Report) -> str:
    """'rank 0 line 12 waits for rank 1 line 30, which waits for rank 0 line 12'."""
    def place(r: int) -> str:
        p = blocked[r]
        loc = rep.plan.ranks[r].instrs[p].loc
        return f"rank {r} line {loc.line}" if loc else f"rank {r} instruction {p}"

    ranks = wait_chain(waits_for, start)
    text = place(ranks[0])
    for k, q in enumerate(ranks[1:]):
        text += (" waits for " if k == 0 else ", which waits for ") + place(q)
    return text
