"""The one grammar of the textual IR, shipped as package data next to this file."""

from __future__ import annotations

from importlib import resources

GRAMMAR_FILE = "tpir.lark"


def grammar_text() -> str:
    """The text of `tpir.lark` (read through importlib.resources so it works from a wheel)."""
    return resources.files(__name__).joinpath(GRAMMAR_FILE).read_text(encoding="utf-8")
