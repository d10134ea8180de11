"""Quantities in reports: bytes in binary units, seconds in ms, a cost model's abstract units."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """'1.50 GiB', '300.00 KiB', '12 B'."""
    for name, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {name}"
    return f"{n:.0f} B"


def format_quantity(value: float, unit: str) -> str:
    """A value in a cost model's unit (`time_unit` / `memory_unit`): bytes as `format_bytes`,
    seconds in ms, anything else as a plain number and its unit."""
    if unit == "B":
        return format_bytes(value)
    if unit == "s":
        return f"{value * 1e3:.3f} ms"
    if unit == "unit":
        return f"{value:.4g} unit{'s' if value != 1 else ''}"
    return f"{value:.4g} {unit}"
