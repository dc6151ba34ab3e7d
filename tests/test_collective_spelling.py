"""One spelling per collective: nccltune's (all_reduce) inside the code, NCCL's (allreduce) only
where NCCL's own formats are written or read, through Collective.tuner_name and from_tuner_name."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from conftest import REPO

from nccltune import collectives
from nccltune.collectives import COLLECTIVES, TUNED, TUNER_NAMES, from_tuner_name
from nccltune.sweep import space
from nccltune.sweep.pertable import SizeCandidate, candidate_of_env, nccl_name
from nccltune.tuner import table

# NCCL's spelling of a collective, alone or as the function of an NCCL_ALGO/NCCL_PROTO entry
# ("allreduce:Tree"); broadcast and reduce are spelled alike by both.
NCCL_SPELLING = re.compile(r"(allreduce|allgather|reducescatter|alltoall)(:.*)?", re.DOTALL)
# The one module that writes NCCL's spelling down; everything else derives it from there.
BOUNDARY = {Path("nccltune/collectives.py")}


def _nccl_spelled(path: Path) -> list[str]:
    """The string constants of one module that are a collective in NCCL's spelling (docstrings and
    comments, prose about NCCL's formats, are not constants of that shape)."""
    tree = ast.parse(path.read_text(), str(path))
    return [f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and NCCL_SPELLING.fullmatch(node.value.strip())]


def test_no_module_but_collectives_spells_a_collective_the_nccl_way() -> None:
    modules = sorted((REPO / "nccltune").rglob("*.py"))
    assert len(modules) > 50  # the package was found
    found = [hit for path in modules if path.relative_to(REPO) not in BOUNDARY for hit in _nccl_spelled(path)]
    assert found == []


def test_the_check_sees_a_literal_and_leaves_prose_alone(tmp_path: Path) -> None:
    """The scan above would catch the spellings it exists for, quoted either way, as an NCCL_ALGO
    entry or inside an f-string, and not a docstring that explains NCCL's syntax."""
    sample = REPO / "tests" / "_spelling_sample.py"
    sample.write_text('"""NCCL_ALGO=allreduce:Tree sets Tree for all-reduce."""\n'
                      "A = 'allgather'\nB = \"allreduce:Tree\"\nC = f\"{A}x\" == f\"reducescatter\"\n"
                      "D = 'all_reduce'\n")
    try:
        hits = _nccl_spelled(sample)
    finally:
        sample.unlink()
    assert [h.split(": ", 1)[1] for h in hits] == ["'allgather'", "'allreduce:Tree'", "'reducescatter'"]


@pytest.mark.parametrize("c", TUNED, ids=lambda c: c.name)
def test_nccl_spelling_round_trips(c: collectives.Collective) -> None:
    assert c.tuner_name is not None and from_tuner_name(c.tuner_name) is c
    assert nccl_name(c.name) == c.tuner_name


def test_nccl_spelling_is_nccls_function_name_in_ncclfunc_order() -> None:
    assert TUNER_NAMES == ("broadcast", "reduce", "allgather", "reducescatter", "allreduce")
    assert [c.tuner_index for c in TUNED] == list(range(len(TUNED)))
    assert all(c.log_func is not None and c.tuner_name == c.log_func.lower() for c in TUNED)
    # The tuner table file and NCCL_ALGO's per-collective entries read the same names.
    assert table.COLLECTIVES == TUNER_NAMES == space.FUNCS


@pytest.mark.parametrize("name", ["all_to_all", "sendrecv"])
def test_point_to_point_collectives_have_no_nccl_tuner_name(name: str) -> None:
    assert COLLECTIVES[name].tuner_name is None
    with pytest.raises(ValueError, match="not a collective NCCL asks a tuner about"):
        nccl_name(name)


@pytest.mark.parametrize("text", ["all_reduce", "AllReduce", "ALLREDUCE", "alltoall", "sendrecv", "", "allreduce "])
def test_anything_but_nccls_exact_spelling_is_no_collective(text: str) -> None:
    assert from_tuner_name(text) is None


def test_an_environment_written_in_nccls_spelling_reads_back_in_nccltunes() -> None:
    cand = SizeCandidate("pat", "simple", only=("all_gather", "reduce_scatter"))
    env = cand.env()
    assert env == {"NCCL_ALGO": "allgather:PAT;reducescatter:PAT",
                   "NCCL_PROTO": "allgather:Simple;reducescatter:Simple"}
    assert candidate_of_env(env) == cand
    assert cand.label == "pat/simple (allgather, reducescatter only)"  # as NCCL_ALGO names them
