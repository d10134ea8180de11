"""The mesh as a value (tpc.ir.mesh): rank <-> coordinates, the groups of each axis, and the rule
that no other module of the tree does rank arithmetic of its own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tpc.ir.mesh import DATA, PIPE, Mesh, tie_pipe_ranks

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("ir", "compiler", "executors", "cli", "bench", "tests", "examples", "scripts")


def test_rank_and_coordinates_are_inverse():
    for pipe, data in [(1, 1), (4, 1), (1, 3), (3, 2), (2, 4)]:
        mesh = Mesh.of(pipe, data)
        assert mesh.size == pipe * data
        for r in mesh.ranks():
            c = mesh.coords(r)
            assert mesh.rank(**c) == r
            assert (mesh.pipe_rank(r), mesh.data_rank(r)) == (c[PIPE], c[DATA])


def test_a_pipeline_is_consecutive_global_ranks():
    """The layout torchrun keeps inside a node: pipe is the fastest axis."""
    mesh = Mesh.of(3, 2)
    assert mesh.groups(PIPE) == [(0, 1, 2), (3, 4, 5)]
    assert mesh.groups(DATA) == [(0, 3), (1, 4), (2, 5)]
    assert mesh.group(DATA, 4) == (1, 4) and mesh.group(PIPE, 4) == (3, 4, 5)
    assert mesh.rank(pipe=2, data=1) == 5


def test_groups_of_pipeline_ranks_in_every_replica():
    mesh = Mesh.of(4, 2)
    assert mesh.select([3, 0], data=1) == (4, 7)
    assert mesh.subgroups([2, 0, 2]) == [(0, 2), (4, 6)]


def test_a_tensor_axis_is_one_more_axis():
    """The design the tensor-parallel issue needs: a third axis, fastest, and every group rule
    still holds."""
    mesh = Mesh((("tensor", 2), (PIPE, 2), (DATA, 2)))
    assert mesh.size == 8
    assert mesh.rank(tensor=1, pipe=1, data=1) == 7
    assert mesh.group("tensor", 5) == (4, 5)
    assert mesh.group(PIPE, 5) == (5, 7)
    assert mesh.group(DATA, 5) == (1, 5)
    assert mesh.subgroups([0, 1]) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert sorted(r for g in mesh.groups("tensor") for r in g) == list(range(8))


def test_the_plans_mesh_puts_the_tensor_axis_fastest_and_keeps_the_old_layout_without_it():
    from tpc.ir.mesh import TENSOR

    mesh = Mesh.of(2, 2, tensor=2)
    assert mesh == Mesh(((TENSOR, 2), (PIPE, 2), (DATA, 2)))
    assert mesh.tensor == 2 and mesh.size == 8
    assert [mesh.tensor_rank(r) for r in mesh.ranks()] == [0, 1] * 4
    assert [mesh.pipe_rank(r) for r in mesh.ranks()] == [0, 0, 1, 1] * 2
    assert mesh.describe() == "data 2 x pipe 2 x tensor 2"
    plain = Mesh.of(3, 2)
    assert plain == Mesh.of(3, 2, tensor=1) and plain.tensor == 1 and TENSOR not in plain.names
    assert [plain.tensor_rank(r) for r in plain.ranks()] == [0] * 6


def test_bad_coordinates_are_refused():
    mesh = Mesh.of(2, 2)
    with pytest.raises(ValueError, match="pipe coordinate 2"):
        mesh.rank(pipe=2)
    with pytest.raises(KeyError, match="expert"):
        mesh.rank(expert=0)
    # without a tensor axis every rank is at tensor coordinate 0 (as `tensor_rank` says), and
    # at no other
    assert mesh.rank(pipe=1, data=1, tensor=0) == mesh.rank(pipe=1, data=1) == 3
    with pytest.raises(KeyError, match="tensor"):
        mesh.rank(tensor=1)
    with pytest.raises(ValueError, match="outside"):
        mesh.coords(4)
    with pytest.raises(ValueError, match="size >= 1"):
        Mesh.of(0, 1)


def test_tie_members_are_each_stages_first_rank():
    assert tie_pipe_ranks([0, 1, 1, 0], [0, 3]) == (0,)
    assert tie_pipe_ranks([0, 1, 2, 3], [3, 0]) == (0, 3)
    assert tie_pipe_ranks([0, 1], [0, 5]) == (0,)  # a stage the verifier refuses counts for nothing


def test_tie_members_are_every_rank_holding_a_replica_of_a_tied_stage():
    chimera = [(0, 3), (1, 2), (2, 1), (3, 0)]  # stage s on ranks s and 3 - s
    assert tie_pipe_ranks(chimera, [0, 3]) == (0, 3)
    assert tie_pipe_ranks(chimera, [0, 1]) == (0, 1, 2, 3)


# ------------------------------------------------------------------- no rank arithmetic elsewhere

AXIS_SIZES = {"pipe", "data"}


def _mentions_axis_size(node: ast.AST) -> bool:
    """`pipe`, `x.pipe`, `data`, `mesh.data`: the size of a mesh axis."""
    return any((isinstance(n, ast.Name) and n.id in AXIS_SIZES)
               or (isinstance(n, ast.Attribute) and n.attr in AXIS_SIZES) for n in ast.walk(node))


def _is_axis_size(node: ast.AST) -> bool:
    return ((isinstance(node, ast.Name) and node.id in AXIS_SIZES)
            or (isinstance(node, ast.Attribute) and node.attr in AXIS_SIZES))


def _mentions_rank(node: ast.AST) -> bool:
    names = [n.id for n in ast.walk(node) if isinstance(n, ast.Name)]
    names += [n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)]
    return any(n == "rank" or n.endswith("_rank") or n in ("me", "r", "g") for n in names)


def rank_arithmetic(source: str) -> list[int]:
    """Lines that compute a global rank from coordinates (`d * pipe + p`) or coordinates from a
    rank (`rank % pipe`, `rank // pipe`)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.BinOp):
            continue
        if isinstance(node.op, (ast.Mod, ast.FloorDiv)):
            if _mentions_rank(node.left) and _mentions_axis_size(node.right):
                lines.append(node.lineno)
        elif isinstance(node.op, ast.Add):
            for side in (node.left, node.right):
                if (isinstance(side, ast.BinOp) and isinstance(side.op, ast.Mult)
                        and (_is_axis_size(side.left) or _is_axis_size(side.right))):
                    lines.append(node.lineno)
                    break
    return lines


def test_the_scan_finds_rank_arithmetic():
    """The rule below can fail: each spelling the tree used to have is found."""
    for bad in ("g = d * pipe + p", "g = self.data_rank * self.pipe + pipe_rank",
                "p = world.rank % pipe", "d = rank // h.mesh.pipe", "x = [d * mesh.pipe + r for d in ds]",
                "g = p + d * pipe"):
        assert rank_arithmetic(bad) == [1], bad
    for fine in ("rows = batch // data", "n = rank % local_size", "x = a * b + c", "q = ranks // pipe",
                 "t = 2 * (data - 1) * lat + 1"):
        assert rank_arithmetic(fine) == [], fine


def test_no_rank_arithmetic_outside_the_mesh():
    """Every rank formula comes from tpc.ir.mesh: a second copy is how the reduce-tied members
    came to be computed two ways."""
    found = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in ("ir/mesh.py", "tests/ir/test_mesh.py") or "/.venv/" in rel:
                continue
            try:
                lines = rank_arithmetic(path.read_text(encoding="utf-8"))
            except SyntaxError:  # a test's deliberately broken model file
                continue
            for line in lines:
                found.append(f"{rel}:{line}")
    assert not found, "rank arithmetic outside ir/mesh.py (use Mesh.rank / coords / groups): " + ", ".join(found)
