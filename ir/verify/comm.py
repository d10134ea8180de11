"""Communication rules across ranks (see tpc.ir.verify): F1 (FIFO channels) and D1 (no
deadlock under the buffered semantics of tpc.ir.semantics)."""

from __future__ import annotations

from collections import defaultdict, deque

from tpc.ir.nodes import Instr, Plan
from tpc.ir.semantics import Message, channel, message, wait_chain
from tpc.ir.verify.report import O, Index, Report, Shape


# ------------------------------------------------------------------------------------ FIFO


def _message(ins: Instr, r: int) -> tuple[int, int, Message]:
    """(sender rank, receiver rank, message) of a send or receive."""
    return (*channel(r, ins), message(ins))


def _channels(plan: Plan, idx: Index):
    """(src, dst) -> ([(position, message)] of sends on src, the same of receives on dst)."""
    chans: dict[tuple[int, int], tuple[list, list]] = defaultdict(lambda: ([], []))
    for r, rp in enumerate(plan.ranks):
        ok = idx.valid[r]
        for p, ins in enumerate(rp.instrs):
            if ok[p] and ins.op in (O.SEND, O.RECV):
                src, dst, msg = _message(ins, r)
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


# -------------------------------------------------------------------------------- deadlock


def check_deadlock(plan: Plan, shape: Shape, idx: Index, rep: Report) -> None:
    """D1: run every rank; a receive waits for its send, reduce-tied for its tie's ranks."""
    n_ranks = len(plan.ranks)
    streams = [
        [(p, ins) for p, ins in enumerate(rp.instrs)
         if idx.valid[r][p] and ins.op in (O.SEND, O.RECV, O.REDUCE_TIED)
         and (ins.op is not O.REDUCE_TIED or ins.tie in shape.ties)]
        for r, rp in enumerate(plan.ranks)
    ]
    ptr = [0] * n_ranks
    sent: set[tuple] = set()
    waiting_msg: dict[tuple, int] = {}
    arrived: dict[str, set[int]] = defaultdict(set)
    waiting_tie: dict[str, list[int]] = defaultdict(list)
    done_ties: set[str] = set()
    ready = deque(range(n_ranks))
    while ready:
        r = ready.popleft()
        stream = streams[r]
        while ptr[r] < len(stream):
            _, ins = stream[ptr[r]]
            if ins.op is O.SEND:
                msg = _message(ins, r)[2]
                sent.add(msg)
                if msg in waiting_msg:
                    ready.append(waiting_msg.pop(msg))
            elif ins.op is O.RECV:
                msg = _message(ins, r)[2]
                if msg not in sent:
                    waiting_msg[msg] = r
                    break
            elif ins.tie not in done_ties:
                arrived[ins.tie].add(r)
                if arrived[ins.tie] >= shape.tie_ranks[ins.tie]:
                    done_ties.add(ins.tie)
                    ready.extend(waiting_tie.pop(ins.tie, []))
                else:
                    waiting_tie[ins.tie].append(r)
                    break
            ptr[r] += 1
    stuck = [r for r in range(n_ranks) if ptr[r] < len(streams[r])]
    if stuck:
        _report_deadlock(plan, shape, idx, rep, streams, ptr, stuck, arrived)


def _report_deadlock(plan, shape, idx, rep, streams, ptr, stuck, arrived) -> None:
    blocked = {r: streams[r][ptr[r]][0] for r in stuck}
    waits_for: dict[int, list[int]] = {}
    for r in stuck:
        ins = plan.ranks[r].instrs[blocked[r]]
        if ins.op is O.RECV:
            waits_for[r] = [ins.peer]
        else:
            waits_for[r] = sorted(shape.tie_ranks[ins.tie] - arrived[ins.tie])
    send_at = _send_positions(plan, idx)
    for r in stuck:
        chain = _wait_chain(r, waits_for, blocked, rep)
        ins = plan.ranks[r].instrs[blocked[r]]
        if ins.op is O.RECV:
            src = ins.peer
            sp = send_at.get(_message(ins, r)[2])
            message = (f"deadlock: rank {r} waits here forever for rank {src}, which never "
                       f"reaches its matching send")
            fix = ""
            if sp is not None and src in blocked:
                fix = (f"; the send at {rep.ref(src, sp)} must run before rank {src} blocks at "
                       f"{rep.at(src, blocked[src])}: move one of them, or this receive")
        else:
            others = ", ".join(str(q) for q in waits_for[r])
            message = (f"deadlock: rank {r} waits here forever for rank(s) {others} to reach "
                       f"reduce-tied \"{ins.tie}\"")
            fix = "; reorder so that every rank of the tie reaches it without waiting on another"
        rep.instr(r, blocked[r], message, chain + fix)


def _send_positions(plan: Plan, idx: Index) -> dict[tuple, int]:
    out: dict[tuple, int] = {}
    for r, rp in enumerate(plan.ranks):
        for p, ins in enumerate(rp.instrs):
            if idx.valid[r][p] and ins.op is O.SEND:
                out.setdefault(_message(ins, r)[2], p)
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
