"""`--slices`: how a micro-batch's sequence is cut into token slices.

    "N"          N slices of (nearly) equal length; the first L mod N slices are one token
                 longer, so lengths differ by at most one and still tile [0, L)
    "l1,l2,..."  explicit lengths, which must be positive and sum to L
    "auto"       left to the optimiser (returned as the string "auto")

The result is the tuple of half-open [start, end) ranges the header's `microbatch` lines carry.
"""

from __future__ import annotations

from tpc.ir.diagnostics import Diagnostic, TpirError

AUTO = "auto"


def _error(message: str, hint: str) -> TpirError:
    return TpirError(Diagnostic(message, hint=hint, where="--slices"))


def equal_slices(count: int, seq_len: int) -> tuple[tuple[int, int], ...]:
    """`count` slices tiling [0, seq_len) whose lengths differ by at most one (longer first)."""
    base, extra = divmod(seq_len, count)
    lengths = [base + 1 if i < extra else base for i in range(count)]
    return ranges_of(lengths)


def ranges_of(lengths) -> tuple[tuple[int, int], ...]:
    """Consecutive [start, end) ranges with the given lengths, starting at 0."""
    out, start = [], 0
    for n in lengths:
        out.append((start, start + n))
        start += n
    return tuple(out)


def parse_slices(spec: str, seq_len: int) -> tuple[tuple[int, int], ...] | str:
    """Parse a `--slices` value for sequences of `seq_len` tokens (see the module docstring)."""
    text = str(spec).strip()
    if text.lower() == AUTO:
        return AUTO
    form_hint = (
        f"give a slice count N (1..{seq_len}), comma-separated lengths summing to {seq_len} "
        f"(e.g. {_example(seq_len)}), or 'auto'"
    )
    parts = [p.strip() for p in text.split(",")]
    if not text or any(not p for p in parts):
        raise _error(f"empty slice length in {spec!r}", form_hint)
    values = []
    for p in parts:
        try:
            values.append(int(p))
        except ValueError:
            raise _error(f"{p!r} in {spec!r} is not a whole number", form_hint) from None
    if len(values) == 1:
        count = values[0]
        if not 1 <= count <= seq_len:
            raise _error(
                f"{count} slices cannot cut a sequence of {seq_len} tokens",
                f"every slice needs at least one token: use 1 to {seq_len} slices",
            )
        return equal_slices(count, seq_len)
    bad = [v for v in values if v < 1]
    if bad:
        raise _error(
            f"slice length {bad[0]} in {spec!r} is not positive",
            f"every slice needs at least one token; {form_hint}",
        )
    total = sum(values)
    if total != seq_len:
        raise _error(
            f"slice lengths {spec!r} sum to {total}, not to the sequence length {seq_len}",
            f"the slices must tile the whole sequence; {form_hint}",
        )
    return ranges_of(values)


def _example(seq_len: int) -> str:
    if seq_len >= 4:
        half = seq_len // 2
        quarter = (seq_len - half) // 2
        return f"{half},{quarter},{seq_len - half - quarter}"
    return ",".join(["1"] * seq_len)
