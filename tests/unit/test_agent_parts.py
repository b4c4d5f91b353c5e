"""Rank 0's snapshot agent gathers the other ranks' manifest parts through a tier: a part seen before it can be read
(empty, cut short, not JSON) is waited for within the bounded wait, never an error at first sight."""

from __future__ import annotations

import json
import threading
import time

import pytest

from lightning_snapshot.backends import LocalTier
from lightning_snapshot.errors import SnapshotError
from lightning_snapshot.persist.commit import _gather_parts

PREFIX, RUN = "step-000000000007", "run1"
PART = {"objects": [{"type": "object", "key": "x", "nbytes": 1, "rank": 1}], "rank_section": {"rank": 1}}


def _raw(tier: LocalTier, name: str, data: bytes) -> None:
    """Put bytes where a part goes without the tier's own write (what a tier that shows objects early leaves)."""
    path = tier.root / PREFIX / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


@pytest.mark.parametrize(
    "early", [b"", b'{"objects": [{"ty', b"\xff\xfe", b"[1, 2]"], ids=["empty", "cut-short", "not-utf8", "not-a-part"]
)
def test_a_part_seen_before_it_is_readable_is_waited_for(tmp_path, early):
    tier = LocalTier(tmp_path / "tier")
    _raw(tier, f"{RUN}-part-00001.json", early)
    later = threading.Timer(0.4, lambda: _raw(tier, f"{RUN}-part-00001.json", json.dumps(PART).encode()))
    later.start()
    try:
        parts = _gather_parts(tier, PREFIX, RUN, 2, {"objects": [], "rank": 0}, time.monotonic() + 30)
    finally:
        later.cancel()
    assert parts == [{"objects": [], "rank": 0}, PART]


def test_a_part_still_unreadable_at_the_deadline_names_rank_step_and_what_was_wrong(tmp_path):
    tier = LocalTier(tmp_path / "tier")
    _raw(tier, f"{RUN}-part-00001.json", b'{"objects": [')
    t0 = time.monotonic()
    with pytest.raises(
        SnapshotError,
        match=r"rank 1's part of step-000000000007 .* still unreadable after 1 s"
        r" .*JSONDecodeError.*Give each run its own",
    ):
        _gather_parts(tier, PREFIX, RUN, 2, {"objects": []}, time.monotonic() + 1)
    assert time.monotonic() - t0 < 10


def test_a_missing_part_at_the_deadline_and_a_failed_rank_are_errors_at_once(tmp_path):
    tier = LocalTier(tmp_path / "tier")
    with pytest.raises(SnapshotError, match="waited 0 s for rank 1's part"):
        _gather_parts(tier, PREFIX, RUN, 2, {"objects": []}, time.monotonic())
    tier.write(f"{PREFIX}/{RUN}-failed-00001.json", [b"{}"])
    t0 = time.monotonic()
    with pytest.raises(SnapshotError, match="rank 1 could not write its part"):
        _gather_parts(tier, PREFIX, RUN, 2, {"objects": []}, time.monotonic() + 60)
    assert time.monotonic() - t0 < 5


def test_a_step_committed_meanwhile_ends_the_wait(tmp_path):
    tier = LocalTier(tmp_path / "tier")
    tier.commit(f"{PREFIX}/manifest.json", b"{}")
    assert _gather_parts(tier, PREFIX, RUN, 2, {"objects": []}, time.monotonic() + 60) is None
