"""docs/architecture.md names every product module, so that a reader finds a thing by its name.

The product modules are the `.py` files under ir/, compiler/, executors/, cli/ and grammar/, less
`__init__.py`. The doc names a module when it mentions it either

1. anywhere, by its path from the repository root or from its top folder, as a whole word:
   `compiler/frontend/sliced.py` or `frontend/sliced.py` (for a module directly in its top
   folder, `compiler/compile.py`, the second is its file name alone: rule 2); or
2. by its file name alone (`sliced.py`) where the text places it in its folder:
   a. inside the section of its top folder -- from the line that opens with that folder in bold
      code (**`compiler/`**) to the next such line or heading -- and, for a module in a
      sub-folder, only where that section also mentions the sub-folder (`frontend/`); or
   b. on a line (in a table: a cell) that also holds the path of a module in the same folder
      (`executors/training/optimizer.py`, `lr.py`, `clip.py` names all three).

Rule 2 is how the doc reads: its folder sections ("`frontend/`: `model_file.py` loads the
model") and its tables (a path, then its neighbours by file name). It keeps a file name shared
by several modules (`compile.py` in cli/, compiler/ and compiler/torch_schedule/) from naming
all of them at once.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("grammar", "ir", "compiler", "executors", "cli", "tpc")


def product_modules() -> list[str]:
    """Every product module's path from the repository root, sorted."""
    return sorted(p.relative_to(ROOT).as_posix() for top in PACKAGES for p in (ROOT / top).rglob("*.py")
                  if p.name != "__init__.py")


def _mentions(text: str, name: str) -> bool:
    """`name` (a path or a file name) occurs in `text` as a whole word, not as the tail of a
    longer name or path (so `sliced.py` is not found in `unsliced.py` or `frontend/sliced.py`)."""
    return re.search(rf"(?<![\w./-]){re.escape(name)}(?![\w-])", text) is not None


def sections(text: str) -> dict[str, str]:
    """The text of each top folder's section: from its **`folder/`** line to the next such line
    or Markdown heading."""
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        opens = re.match(r"\*\*`(\w+)/`\*\*", line)
        if opens:
            current = opens.group(1)
        elif line.startswith("#"):
            current = None
        if current is not None:
            out.setdefault(current, []).append(line)
    return {k: "\n".join(v) for k, v in out.items()}


def named(module: str, text: str, parts: dict[str, str]) -> bool:
    top, *subs, file = module.split("/")
    if _mentions(text, module) or (subs and _mentions(text, "/".join((*subs, file)))):
        return True
    section = parts.get(top, "")
    if _mentions(section, file) and all(_mentions(section, "/".join(subs[:k + 1]) + "/")
                                        for k in range(len(subs))):
        return True
    folder = "/".join((top, *subs)) + "/"
    return any(_mentions(cell, file) and re.search(rf"(?<![\w./-]){re.escape(folder)}[\w.-]+\.py", cell)
               for line in text.splitlines() for cell in line.split("|"))


def missing_modules() -> list[str]:
    text = DOC.read_text()
    parts = sections(text)
    return [m for m in product_modules() if not named(m, text, parts)]


def test_the_rule_reads_the_doc_as_intended():
    text = ("**`compiler/`** turns a model into a plan:\n- `frontend/`: `sliced.py` runs the passes.\n"
            "- `compile.py` is the driver.\n**`cli/`** is the command.\n## A table\n| `lr.py` |\n"
            "see `executors/training/clip.py`, `training/optimizer.py`\n"
            "| `executors/run.py`, `progress.py` | `executors/training/checkpoint.py`, `model_state.py` |\n")
    parts = sections(text)
    assert set(parts) == {"compiler", "cli"} and "lr.py" not in parts["cli"]
    assert named("compiler/frontend/sliced.py", text, parts)
    assert named("compiler/compile.py", text, parts)
    assert not named("compiler/torch_schedule/compile.py", text, parts)  # its sub-folder is not named
    assert not named("cli/compile.py", text, parts)  # another section's file name
    assert not named("executors/training/lr.py", text, parts)  # a bare name outside its section
    assert named("executors/training/clip.py", text, parts)
    assert named("executors/training/optimizer.py", text, parts)
    assert named("executors/training/model_state.py", text, parts)  # beside a path of its folder
    assert not named("executors/training/progress.py", text, parts)  # beside a path of another
    assert not named("compiler/frontend/unsliced.py", "`sliced.py`", {"compiler": "`frontend/` `sliced.py`"})
    assert "compiler/frontend/sliced.py" in product_modules()



def test_the_architecture_doc_names_every_module():
    missing = missing_modules()
    assert not missing, ("docs/architecture.md does not name these modules (by path, or by file "
                         "name in its folder's section): " + ", ".join(missing))
