"""THE rule for which part of a published set a job gets by its node count (publish/shapes.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nccltune.publish.readback import PublishedSet, job_env
from nccltune.publish.shapes import part_for_shape, shape_key

SAFE = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
PARTS = {1: {"NCCL_MIN_NCHANNELS": "32"}, 2: {"NCCL_ALGO": "Ring"}, 4: {"NCCL_ALGO": "Tree"},
         16: {"NCCL_ALGO": "Tree", "NCCL_IB_QPS_PER_CONNECTION": "4"}}


@pytest.mark.parametrize(("nnodes", "key"), [(None, None), (0, None), (1, 1), (2, 2), (3, 2), (4, 4),
                                             (15, 4), (16, 16), (512, 16)])
def test_a_job_gets_the_part_of_the_largest_measured_count_not_above_its_own(nnodes: int | None,
                                                                             key: int | None) -> None:
    assert shape_key(PARTS, nnodes) == key
    expected = {**SAFE, **PARTS[key]} if key is not None else SAFE
    assert part_for_shape(SAFE, PARTS, nnodes) == expected


def test_a_single_node_part_never_reaches_a_multi_node_job() -> None:
    only_single = {1: {"NCCL_MIN_NCHANNELS": "32"}}
    assert shape_key(only_single, 2) is None
    assert part_for_shape(SAFE, only_single, 8) == SAFE
    # Measured on 4 nodes only: a 2-node job gets the safe part, not values of a larger shape.
    assert part_for_shape(SAFE, {4: {"NCCL_ALGO": "Tree"}}, 2) == SAFE


def test_job_env_of_a_published_set_follows_the_rule() -> None:
    got = PublishedSet(Path("/nonexistent"), 1, dict(SAFE), {}, {}, single_node_env=dict(PARTS[1]))
    assert job_env(got, 1) == {**SAFE, **PARTS[1]}
    assert job_env(got, None) == SAFE
    assert job_env(got, 2) == SAFE
    # With parts by node count: exactly part_for_shape's answer for every shape.
    shaped = PublishedSet(Path("/nonexistent"), 1, dict(SAFE), {}, {}, single_node_env=dict(PARTS[1]),
                          nodes_env={n: dict(p) for n, p in PARTS.items() if n > 1})
    assert shaped.parts == PARTS
    for nnodes in (None, 1, 2, 3, 8, 16, 512):
        assert job_env(shaped, nnodes) == part_for_shape(SAFE, PARTS, nnodes)


def test_the_jobs_a_part_reaches() -> None:
    from nccltune.publish.shapes import part_reach

    assert [part_reach([1, 2, 4, 16], n) for n in (2, 4, 16)] == [(2, 3), (4, 15), (16, None)]


def test_the_safe_part_after_an_upgrade_keeps_only_wiring_and_error_handling() -> None:
    from nccltune.fleet.upgrade import safe_part

    env = {"NCCL_ALGO": "Ring", "NCCL_IB_HCA": "mlx5_0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
           "NCCL_BUFFSIZE": "8388608", "NCCL_SOMETHING_NEW": "1"}
    kept, left_out = safe_part(env)
    assert kept == {"NCCL_IB_HCA": "mlx5_0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    assert left_out == ["NCCL_ALGO", "NCCL_BUFFSIZE", "NCCL_SOMETHING_NEW"]
