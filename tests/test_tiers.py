"""The fast tier (`pytest -m "not slow"`): the list of slow tests in tests/conftest.py names tests
that exist, and marks a test by its whole node id, never by a longer name's prefix."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import SLOW, _is_slow

ROOT = Path(__file__).resolve().parent.parent


def test_every_slow_entry_names_a_test_file_or_function():
    stale = []
    for entry in SLOW:
        path, _, rest = entry.partition("::")
        file = ROOT / path
        if not file.exists():
            stale.append(f"{entry}: no {path}")
            continue
        name = rest.split("[")[0].split("::")[0]
        if name and not re.search(rf"^\s*(def|class) {re.escape(name)}\b", file.read_text(), re.M):
            stale.append(f"{entry}: {path} has no {name}")
    assert not stale, "stale entries of SLOW in tests/conftest.py (a test moved or was renamed):\n" + "\n".join(stale)


def test_an_entry_marks_whole_node_ids_only():
    assert SLOW and len(set(SLOW)) == len(SLOW)
    entry = SLOW[0]
    assert _is_slow(entry)
    assert _is_slow(entry + "::test_x[case]") if "::" not in entry else _is_slow(entry + "[case]")
    assert not _is_slow(entry + "_other") and not _is_slow(entry + "x")
