"""Which rank writes which replicated tensor (DDP): disjoint, balanced, deterministic."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_snapshot.plan.planner import assign_writers


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10**9), max_size=60), st.integers(1, 16))
def test_every_blob_has_one_writer_and_loads_are_balanced(sizes, world):
    owners = assign_writers(sizes, world)
    assert len(owners) == len(sizes) and all(0 <= r < world for r in owners)
    loads = [sum(s for s, r in zip(sizes, owners) if r == rank) for rank in range(world)]
    # greedy largest-first: no rank carries more than the average plus the largest blob
    assert max(loads) <= sum(sizes) / world + max(sizes, default=0)
    assert assign_writers(list(sizes), world) == owners  # deterministic


def test_pinned_blobs_stay_with_their_rank_and_count_towards_its_load():
    owners = assign_writers([100, 10, 10, 10, 10], 2, pinned=[0, None, None, None, None])
    assert owners[0] == 0 and owners[1:] == [1, 1, 1, 1]


def test_world_size_must_be_positive():
    with pytest.raises(ValueError, match="world_size"):
        assign_writers([1], 0)
