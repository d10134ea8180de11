"""Token slices: how a micro-batch's sequence is cut (`--slices`).

    N            N slices of (nearly) equal length; the first L mod N slices are one token
                 longer, so lengths differ by at most one and still tile [0, L)
    (l1, l2,...) explicit lengths, which must be positive and sum to L
    AUTO         left to the optimiser

The header's `microbatch` lines carry the half-open [start, end) ranges (`equal_slices`,
`ranges_of`). The command line's spelling of these ("4", "6,3,1", "auto") is read by
`tpc.cli.compile.parse_slices`.
"""

from __future__ import annotations

from tpc.ir.diagnostics import Diagnostic, TpirError

AUTO = "auto"


def _error(message: str, hint: str) -> TpirError:
    return TpirError(Diagnostic(message, hint=hint, where="--slices"))


def even_split(total: int, count: int) -> tuple[int, ...]:
    """`total` split into `count` whole parts that differ by at most one, larger first (slice
    lengths of a sequence, micro-batch sizes of a batch)."""
    base, extra = divmod(total, count)
    return tuple(base + 1 if i < extra else base for i in range(count))


def equal_slices(count: int, seq_len: int) -> tuple[tuple[int, int], ...]:
    """`count` slices tiling [0, seq_len) whose lengths differ by at most one (longer first)."""
    return ranges_of(even_split(seq_len, count))


def ranges_of(lengths) -> tuple[tuple[int, int], ...]:
    """Consecutive [start, end) ranges with the given lengths, starting at 0 (from boundaries
    instead: `tpc.compiler.optimise.balance.ranges_from_bounds`)."""
    out, start = [], 0
    for n in lengths:
        out.append((start, start + n))
        start += n
    return tuple(out)


def check_slices(slices, seq_len: int) -> None:
    """Refuse a `slices` value that cannot cut sequences of `seq_len` tokens: a count outside
    1..seq_len, or lengths that are not positive or do not sum to seq_len (AUTO passes)."""
    if slices == AUTO:
        return
    form_hint = (
        f"give a slice count N (1..{seq_len}), comma-separated lengths summing to {seq_len} "
        f"(e.g. {slice_example(seq_len)}), or 'auto'"
    )
    if isinstance(slices, int) and not isinstance(slices, bool):
        if not 1 <= slices <= seq_len:
            raise _error(
                f"{slices} slices cannot cut a sequence of {seq_len} tokens",
                f"every slice needs at least one token: use 1 to {seq_len} slices",
            )
        return
    if not isinstance(slices, tuple) or not slices or not all(isinstance(v, int) for v in slices):
        raise _error(f"slices {slices!r} is neither a count nor a tuple of lengths", form_hint)
    spec = ",".join(map(str, slices))
    bad = [v for v in slices if v < 1]
    if bad:
        raise _error(
            f"slice length {bad[0]} in {spec!r} is not positive",
            f"every slice needs at least one token; {form_hint}",
        )
    total = sum(slices)
    if total != seq_len:
        raise _error(
            f"slice lengths {spec!r} sum to {total}, not to the sequence length {seq_len}",
            f"the slices must tile the whole sequence; {form_hint}",
        )


def slice_example(seq_len: int) -> str:
    """A valid --slices example for sequences of `seq_len` tokens, for hints."""
    if seq_len >= 4:
        half = seq_len // 2
        quarter = (seq_len - half) // 2
        return f"{half},{quarter},{seq_len - half - quarter}"
    return ",".join(["1"] * seq_len)
