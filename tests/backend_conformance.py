"""The ``Backend`` contract (``backends/base.py``) as one class of tests that every tier subclasses.

As zarr's ``StoreTests`` and fsspec's abstract test classes: :class:`BackendTests` holds the tests, a subclass per
tier (``tests/test_backends.py``) supplies two things and names where the tier legitimately differs:

* the fixture ``new_backend``: a factory ``new_backend(**options) -> Backend`` making a fresh tier each call (its root
  not created yet), with the given constructor options (``keep_last=...``);
* :meth:`BackendTests.raw_names`: every object under the tier's root, hidden ones included, read *without* the
  backend's own methods (the files on disk, the bucket's keys), so the tests see what a backend leaves behind;
* the class attributes below, each documented where it is set.

This module is not collected by itself (its name does not start with ``test_``); only its subclasses are.
"""

from __future__ import annotations

import array
import concurrent.futures as cf
import pickle
import re
import time
from pathlib import Path

import pytest
import torch

from lightning_snapshot.backends.base import Backend, Distributing, LayoutSettling
from lightning_snapshot.dist.comm import LocalComm
from lightning_snapshot.errors import SnapshotNotFoundError, SnapshotWriteError, UnsafePathError
from lightning_snapshot.format.manifest import MANIFEST_NAME, step_dirname
from lightning_snapshot.persist.writer import (
    SnapshotJob,
    apply_retention,
    committed_steps,
    expired_snapshots,
    write_snapshot,
)
from lightning_snapshot.restore.loader import load_snapshot
from lightning_snapshot.staging import stage

__all__ = ["UNSAFE_KEYS", "BackendTests"]

#: Keys that would leave the tier's root or hold characters a key may not hold; each must be refused with
#: ``UnsafePathError`` by every method that takes a key, before anything is read or written.
UNSAFE_KEYS = ["..", "../outside.bin", "a/../../x", "/etc/passwd", "", "a//b", "a/", ".", "a\\b", "a\0b", "a b", "é"]
_UNSAFE_MESSAGE = "would escape the tier root|is empty or not a string"


def _snapshot(backend: Backend, step: int, *, run_id: str = "run1", value: float | None = None):
    """Write and commit a small snapshot of ``step`` (a shared and a per-rank section) as one rank does."""
    value = float(step) if value is None else value
    job = SnapshotJob(
        step,
        0,
        shared=stage({"step": step, "w": torch.full((4,), value)}),
        private=stage({"r": torch.tensor([step])}, "rank"),
    )
    return write_snapshot(backend, LocalComm(), job, run_id=run_id)


def _crashed_write(backend: Backend, step: int, name: str = "crashed-rank-00000.bin") -> None:
    """What a writer killed before its commit leaves: a data object of ``step`` and no manifest."""
    backend.write(f"{step_dirname(step)}/{name}", [b"\0" * 100])


class BackendTests:
    """The contract of :class:`~lightning_snapshot.backends.base.Backend`, for one tier (see the module doc)."""

    #: ``commit`` of a key that is already committed: True when it replaces it atomically (readers see the old or
    #: the whole new object: local files, RAM); False when it refuses with ``SnapshotWriteError`` and keeps the old
    #: one (object stores: a conditional create, so a committed step is never overwritten).
    replaces_committed: bool = True
    #: Whether ``modified`` reports when an object or prefix last changed (False: it returns None for everything,
    #: which the base class allows; ``lightning-snapshot gc`` then never removes the tier's uncommitted leftovers).
    tells_modified: bool = True
    #: The message of the ``SnapshotNotFoundError`` that ``require_exists`` raises for a tier whose root does not
    #: exist (a regular expression; it names where the tier was looked for).
    missing_root_message: str = "no snapshot tier"

    # ------------------------------------------------------------------------------------------- supplied
    @pytest.fixture
    def new_backend(self):
        """A factory ``new_backend(**options)`` of fresh backends of this tier; subclasses override it."""
        raise NotImplementedError

    def raw_names(self, backend: Backend) -> list[str]:
        """Every object under ``backend``'s root (keys relative to it, hidden ones too), sorted; read without the
        backend's own methods."""
        raise NotImplementedError

    @pytest.fixture
    def backend(self, new_backend) -> Backend:
        return new_backend()

    # ------------------------------------------------------------------------------------------- write, read
    def test_write_concatenates_its_buffers_and_read_gives_them_back(self, backend):
        ints = array.array("i", [1, 2, 3])  # a buffer of 4-byte items: written as its bytes
        buffers = [b"abc", bytearray(b"def"), memoryview(b"ghij")[1:], memoryview(ints)]
        expected = b"abcdefhij" + ints.tobytes()
        assert backend.write("p/obj.bin", buffers) == len(expected)
        assert backend.read("p/obj.bin") == expected
        assert bytes(backend.read_view("p/obj.bin")) == expected
        assert backend.exists("p/obj.bin")
        assert self.raw_names(backend) == ["p/obj.bin"]

    def test_an_empty_object_is_an_object(self, backend):
        assert backend.write("p/empty.bin", []) == 0
        assert backend.write("p/zero.bin", [b""]) == 0
        assert backend.read("p/empty.bin") == b"" and bytes(backend.read_view("p/zero.bin")) == b""
        assert backend.exists("p/empty.bin") and backend.list("p") == ["empty.bin", "zero.bin"]

    @pytest.mark.parametrize("replacing", [False, True], ids=["new", "replacing"])
    def test_a_concurrent_reader_never_sees_a_partial_object(self, backend, replacing):
        """Another process polls for an object (a rank's manifest part, a restore record) through its own instance
        of the tier while a writer fills it slowly: whenever the object exists, it reads whole (the old or the new
        one), never empty or in part; and the write in progress is never listed."""
        import threading

        old, pieces = b"the previous object", [bytes([65 + i]) * 4096 for i in range(8)]
        if replacing:
            backend.write("p/part.json", [old])
        reader = Backend.from_spec(backend.spec())  # (the other process's own instance)
        seen: list[bytes | str] = []
        done = threading.Event()

        def slow_buffers():
            for piece in pieces:  # the object's bytes arrive over 0.4 s: a wide window for a reader
                time.sleep(0.05)
                yield piece

        def poll():
            while not done.is_set():
                if reader.exists("p/part.json"):
                    try:
                        seen.append(bytes(reader.read("p/part.json")))
                    except FileNotFoundError:  # (replaced between the two calls: also whole)
                        continue
                if any(n.startswith(".") for n in reader.list("p")):
                    seen.append("a hidden name was listed")
                time.sleep(0.002)

        thread = threading.Thread(target=poll)
        thread.start()
        try:
            backend.write("p/part.json", slow_buffers())
        finally:
            done.set()
            thread.join()
        whole = {b"".join(pieces), *([old] if replacing else [])}
        bad = [x if isinstance(x, str) else f"{len(x)} bytes" for x in seen if x not in whole]
        assert not bad, f"a concurrent reader saw {bad[:3]} while the object was written"
        assert reader.read("p/part.json") == b"".join(pieces)
        assert self.raw_names(backend) == ["p/part.json"]

    def test_write_replaces_an_object_whole(self, backend):
        backend.write("p/obj.bin", [b"a much longer first version"])
        assert backend.write("p/obj.bin", [b"short"]) == 5
        assert backend.read("p/obj.bin") == b"short"
        assert self.raw_names(backend) == ["p/obj.bin"]

    def test_a_missing_object_is_file_not_found_naming_the_key(self, backend):
        backend.write("p/there.bin", [b"x"])
        for call in (
            lambda: backend.read("p/missing.bin"),
            lambda: backend.read_view("p/missing.bin"),
            lambda: backend.read_into("p/missing.bin", 0, memoryview(bytearray(1))),
        ):
            with pytest.raises(FileNotFoundError, match="p/missing.bin"):
                call()
        assert not backend.exists("p/missing.bin")

    # ------------------------------------------------------------------------------------------- ranged reads
    def test_ranged_reads_fill_exactly_the_bytes_asked_for(self, backend):
        data = bytes(range(256)) * 40
        backend.write("p/obj.bin", [data[:1000], data[1000:]])
        before = backend.bytes_read  # (None: the tier declares that it does not count)
        asked = 0
        for offset, length in ((0, 1), (0, len(data)), (1000, 10), (999, 2), (len(data) - 3, 3), (4097, 1234)):
            out = bytearray(length + 2)  # only the view's bytes are written: the guard bytes stay
            backend.read_into("p/obj.bin", offset, memoryview(out)[1:-1])
            assert out == b"\0" + data[offset : offset + length] + b"\0", (offset, length)
            asked += length
        if before is not None:
            assert backend.bytes_read - before == asked  # ranged reads fetch what they are asked for, no more

    def test_a_read_past_the_end_raises_eof_naming_the_key(self, backend):
        backend.write("p/obj.bin", [b"0123456789"])
        for offset, length in ((8, 3), (10, 1), (100, 5)):
            with pytest.raises(EOFError, match="p/obj.bin"):
                backend.read_into("p/obj.bin", offset, memoryview(bytearray(length)))
        out = bytearray(b"untouched")
        backend.read_into("p/obj.bin", 10, memoryview(out)[:0])  # nothing asked at the end: nothing read
        assert out == b"untouched"

    def test_ranged_reads_from_parallel_threads(self, backend):
        data = bytes(range(251)) * 100  # (a prime period: a piece read at the wrong offset differs)
        backend.write("p/obj.bin", [data])
        pieces = [(i * 2999, 2999) for i in range(len(data) // 2999)]

        def read(piece):
            out = bytearray(piece[1])
            backend.read_into("p/obj.bin", piece[0], memoryview(out))
            return bytes(out) == data[piece[0] : piece[0] + piece[1]]

        with cf.ThreadPoolExecutor(max_workers=max(2, backend.parallel_reads)) as pool:
            assert all(pool.map(read, pieces))

    # ------------------------------------------------------------------------------------------- list, exists, delete
    def test_list_names_the_direct_children_sorted_without_hidden_ones(self, backend):
        for key in ("p/b.bin", "p/a", "p/a.bin", "p/sub/c.bin", "p/sub/deeper/d.bin", "p/.hidden", "q.bin"):
            backend.write(key, [b"x"])
        assert backend.list("p") == ["a", "a.bin", "b.bin", "sub"]
        assert backend.list("p/sub") == ["c.bin", "deeper"]
        assert backend.list("") == ["p", "q.bin"]

    def test_listing_a_missing_prefix_or_an_object_is_empty(self, backend):
        assert backend.list("") == []  # (the root does not exist yet)
        backend.write("p/a.bin", [b"x"])
        assert backend.list("nothing") == [] and backend.list("p/nothing") == []
        assert backend.list("p/a.bin") == []  # an object has no children

    def test_exists_is_true_for_objects_only(self, backend):
        backend.write("p/sub/a.bin", [b"x"])
        assert backend.exists("p/sub/a.bin")
        assert not backend.exists("p/sub") and not backend.exists("p")  # prefixes are not objects
        assert not backend.exists("p/sub/a") and not backend.exists("p/sub/a.bin.x")

    def test_delete_removes_an_object_or_a_prefix_and_nothing_beside_it(self, backend):
        for key in ("p/a", "p/a.bin", "p/ab", "p/a2/x.bin", "p/sub/c.bin", "p/sub/deeper/d.bin", "p/sub/.hidden"):
            backend.write(key, [b"x"])
        backend.delete("p/a")
        assert backend.list("p") == ["a.bin", "a2", "ab", "sub"]  # not the objects whose names start alike
        assert not backend.exists("p/a")
        with pytest.raises(FileNotFoundError):
            backend.read("p/a")
        backend.delete("p/sub")  # a prefix: everything under it, hidden objects too
        assert backend.list("p") == ["a.bin", "a2", "ab"]
        assert self.raw_names(backend) == ["p/a.bin", "p/a2/x.bin", "p/ab"]

    def test_deleting_what_does_not_exist_is_not_an_error(self, backend):
        backend.delete("p/missing.bin")
        backend.delete("never/written")
        backend.write("p/a.bin", [b"x"])
        backend.delete("p/missing.bin")
        assert self.raw_names(backend) == ["p/a.bin"]

    # ------------------------------------------------------------------------------------------- commit rule
    def test_commit_publishes_the_whole_object_and_leaves_nothing_else(self, backend):
        backend.write("step/a.bin", [b"data"])
        backend.commit(f"step/{MANIFEST_NAME}", b'{"first": true}')
        assert backend.read(f"step/{MANIFEST_NAME}") == b'{"first": true}'
        assert backend.list("step") == ["a.bin", MANIFEST_NAME]
        assert self.raw_names(backend) == ["step/a.bin", f"step/{MANIFEST_NAME}"]  # no temporary object left

    def test_committing_a_committed_key_again(self, backend):
        backend.commit(f"step/{MANIFEST_NAME}", b"first")
        if self.replaces_committed:
            backend.commit(f"step/{MANIFEST_NAME}", b"second, longer")
            assert backend.read(f"step/{MANIFEST_NAME}") == b"second, longer"
        else:
            with pytest.raises(SnapshotWriteError, match="already committed.*never overwritten"):
                backend.commit(f"step/{MANIFEST_NAME}", b"second, longer")
            assert backend.read(f"step/{MANIFEST_NAME}") == b"first"
        assert self.raw_names(backend) == [f"step/{MANIFEST_NAME}"]

    def test_committing_the_same_bytes_again_succeeds(self, backend):
        # (a retried commit whose first request landed but whose answer was lost)
        backend.commit(f"step/{MANIFEST_NAME}", b"the manifest")
        backend.commit(f"step/{MANIFEST_NAME}", b"the manifest")
        assert backend.read(f"step/{MANIFEST_NAME}") == b"the manifest"
        assert self.raw_names(backend) == [f"step/{MANIFEST_NAME}"]

    def test_data_without_a_manifest_is_not_a_snapshot(self, new_backend):
        backend = new_backend(keep_last=None)
        _snapshot(backend, 5)
        _crashed_write(backend, 7)
        assert backend.list("") == [step_dirname(5), step_dirname(7)]
        assert committed_steps(backend) == [5]
        with pytest.raises(SnapshotNotFoundError):
            load_snapshot(backend, step=7)
        assert load_snapshot(backend)["step"] == 5  # the newest committed one

    def test_a_second_write_of_a_committed_step(self, backend):
        _snapshot(backend, 3, run_id="aaa", value=1.0)
        if self.replaces_committed:
            _snapshot(backend, 3, run_id="bbb", value=2.0)
            objects = ["bbb-rank-00000.bin", "bbb-shared-00000.bin"]  # the first write's objects are gone
            value = 2.0
        else:
            with pytest.raises(SnapshotWriteError, match="never overwritten"):
                _snapshot(backend, 3, run_id="bbb", value=2.0)
            objects = ["aaa-rank-00000.bin", "aaa-shared-00000.bin"]  # the refused write's objects are gone
            value = 1.0
        assert backend.list(step_dirname(3)) == [*objects, MANIFEST_NAME]
        out = load_snapshot(backend, rank=0)
        assert torch.equal(out["w"], torch.full((4,), value)) and torch.equal(out["rank_state"]["r"], torch.tensor([3]))

    # ------------------------------------------------------------------------------------------- retention
    def test_retention_keeps_the_keep_last_newest(self, new_backend):
        backend = new_backend(keep_last=None)  # every snapshot, then 2, then 1
        deleted = []
        for step, keep_last in ((1, None), (2, None), (3, None), (4, 2), (5, 2), (6, 1)):
            backend.keep_last = keep_last
            _snapshot(backend, step)
            expired = expired_snapshots(committed_steps(backend), keep_last, keep={step})
            deleted.append(apply_retention(backend, step))
            assert sorted(deleted[-1]) == sorted(expired)
        assert deleted == [[], [], [], [1, 2], [3], [4, 5]]
        assert committed_steps(backend) == [6]
        assert backend.list("") == [step_dirname(6)]
        assert torch.equal(load_snapshot(backend)["w"], torch.full((4,), 6.0))

    def test_retention_removes_older_leftovers_only_and_ignores_foreign_names(self, new_backend):
        backend = new_backend(keep_last=1)
        for key in ("notes.txt", "step-12/x.bin", f"{step_dirname(1)}.bak/x.bin"):  # not snapshot directories
            backend.write(key, [b"mine"])
        _snapshot(backend, 2)
        _crashed_write(backend, 3)
        _crashed_write(backend, 9, "another-writer-rank-00000.bin")  # may be a step in flight: newer than ours
        assert apply_retention(backend, 2) == []  # nothing committed is newer than the leftover of step 3
        _snapshot(backend, 4)
        assert apply_retention(backend, 4) == [2, 3]
        assert backend.list("") == sorted(
            ["notes.txt", "step-12", f"{step_dirname(1)}.bak", step_dirname(4), step_dirname(9)]
        )
        assert committed_steps(backend) == [4]

    def test_retention_never_deletes_the_step_just_written(self, new_backend):
        backend = new_backend(keep_last=None)
        _snapshot(backend, 9, run_id="old")
        _snapshot(backend, 8, run_id="old")
        backend.keep_last = 1
        _snapshot(backend, 5, run_id="new")  # a run resumed from an earlier snapshot
        assert apply_retention(backend, 5) == [8]  # keeps the newest (9) and the one just written (5)
        assert committed_steps(backend) == [9, 5]
        assert load_snapshot(backend, step=5)["step"] == 5

    # ------------------------------------------------------------------------------------------- unsafe keys
    def test_an_unsafe_key_is_refused_before_anything_is_touched(self, backend):
        backend.write("p/a.bin", [b"x"])
        for key in UNSAFE_KEYS:
            calls = {
                "read": lambda: backend.read(key),
                "read_view": lambda: backend.read_view(key),
                "read_into": lambda: backend.read_into(key, 0, memoryview(bytearray(1))),
                "write": lambda: backend.write(key, [b"x"]),
                "commit": lambda: backend.commit(key, b"x"),
                "delete": lambda: backend.delete(key),
                "exists": lambda: backend.exists(key),
            }
            if key:  # ("" lists the root)
                calls["list"] = lambda: backend.list(key)
            if self.tells_modified:
                calls["modified"] = lambda: backend.modified(key)
            for name, call in calls.items():
                with pytest.raises(UnsafePathError, match=_UNSAFE_MESSAGE) as err:
                    call()
                assert repr(key) in str(err.value), (name, key)
        assert self.raw_names(backend) == ["p/a.bin"]

    # ------------------------------------------------------------------------------------------- the rest of base.py
    def test_require_exists_tells_a_missing_tier_from_an_empty_one(self, backend):
        with pytest.raises(SnapshotNotFoundError, match=self.missing_root_message):
            backend.require_exists()
        assert self.raw_names(backend) == []  # it creates nothing
        backend.write("p/a.bin", [b"x"])
        backend.require_exists()

    def test_check_writes_a_probe_and_leaves_nothing(self, backend):
        backend.check()
        assert self.raw_names(backend) == [] and backend.list("") == []

    def test_modified_is_the_newest_change_under_a_key(self, backend):
        start = time.time()
        backend.write("p/a.bin", [b"x"])
        backend.write("p/sub/b.bin", [b"y"])
        end = time.time()
        if not self.tells_modified:
            assert backend.modified("p/a.bin") is None and backend.modified("p") is None
            return
        a, b, p = backend.modified("p/a.bin"), backend.modified("p/sub/b.bin"), backend.modified("p")
        # (object stores keep whole seconds)
        assert all(isinstance(t, float) and start - 1 <= t <= end + 1 for t in (a, b, p)), (start, a, b, p, end)
        assert p >= max(a, b) - 1e-6
        assert backend.modified("p/missing.bin") is None and backend.modified("nothing") is None

    def test_url_and_repr_name_the_tier(self, backend):
        assert isinstance(backend.url, str) and backend.url
        assert repr(backend).startswith(f"{type(backend).__name__}({backend.url!r},")
        assert isinstance(backend.tier, str) and re.fullmatch(r"[a-z0-9]+", backend.tier)
        assert isinstance(backend.durable, bool) and backend.parallel_reads >= 1

    def test_capabilities_are_declared_values_of_their_documented_types(self, backend):
        """Every optional capability is declared on ``Backend`` (the engine never probes for it): a tier that lacks
        one reads the documented default."""

        def number_or_none(value, least):
            return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= least)

        assert isinstance(backend.node_local, bool) and isinstance(backend.node_leader, bool)
        assert number_or_none(backend.retry_initial, 0) and number_or_none(backend.retry_max, 0)
        assert (backend.retry_max is not None) or not backend.retry_initial  # (retries need their longest wait)
        assert number_or_none(backend.drain_timeout, 0) and number_or_none(backend.max_pending, 1)
        assert backend.bytes_read is None or isinstance(backend.bytes_read, int)
        assert backend.read_piece_bytes is None or backend.read_piece_bytes > 0
        assert backend.root is None or isinstance(backend.root, (str, Path))
        assert backend.redact("nothing secret here") == "nothing secret here"
        assert isinstance(backend.incomplete_uploads(), list)
        if isinstance(backend, LayoutSettling):  # (one node: settled without probe files)
            backend.bind(node_rank=0, num_nodes=1, local_rank=0, ranks_per_node=1)
            assert isinstance(backend.settle_layout(LocalComm(), "run1"), str) and not backend.node_local
        if isinstance(backend, Distributing):  # (nothing written: nothing to place)
            backend.distribute(LocalComm(), step_dirname(1), "run1")
        assert self.raw_names(backend) == []

    def test_a_restore_outside_training_is_the_read_itself(self, backend):
        """``restore`` on one process (no other node): the read's result, and the tier as before."""
        _snapshot(backend, 2)
        before = self.raw_names(backend)
        assert backend.restore(LocalComm(), 2, lambda: load_snapshot(backend)["step"]) == 2
        assert self.raw_names(backend) == before
        if backend.node_local:  # (what any node holds: here, this one; the others are listed on one rank)
            assert backend.collective_steps(LocalComm()) in (None, [2])

    def test_a_pickled_or_respecified_tier_reads_and_writes_the_same_objects(self, backend):
        backend.write("p/a.bin", [b"written before"])
        for again in (pickle.loads(pickle.dumps(backend)), Backend.from_spec(backend.spec())):
            assert type(again) is type(backend) and again.url == backend.url
            assert (again.every_n_train_steps, again.keep_last) == (backend.every_n_train_steps, backend.keep_last)
            assert again.read("p/a.bin") == b"written before"
            again.write(f"p/{len(self.raw_names(backend))}.bin", [b"written after"])
        assert backend.list("p") == ["1.bin", "2.bin", "a.bin"]
        assert backend.read("p/2.bin") == b"written after"
