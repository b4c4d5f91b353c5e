"""Read once, share (lightning_snapshot/restore/read_once.py and planner.plan_shared_reads): ranks are threads
(``thread_comm.ThreadComm``) restoring a DDP-like snapshot written by the writer itself, each with its own tier
instance, whose byte counter (``LocalTier.bytes_read``, counted in ``read_into``) says what it read."""

from __future__ import annotations

import json

import pytest
import torch
from thread_comm import ThreadComm, run_ranks

from lightning_snapshot.backends import LocalTier
from lightning_snapshot.errors import SnapshotError
from lightning_snapshot.format.manifest import MANIFEST_NAME, step_dirname
from lightning_snapshot.persist.commit import merge_parts
from lightning_snapshot.persist.writer import SnapshotJob, write_part
from lightning_snapshot.plan.planner import assign_writers, plan_shared_reads, shard_boxes
from lightning_snapshot.restore.loader import ReadStats, ShardTarget, read_manifest, read_section
from lightning_snapshot.restore.read_once import ReadOnce
from lightning_snapshot.staging import stage

CHUNK = 4096


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(300, 257, generator=g),
        "b": torch.randn(33, generator=g),
        "h": torch.randn(64, 100, generator=g).half(),
        "i": torch.randint(0, 1 << 40, (129,), generator=g),
        "e": torch.empty(0),
    }


def _write(root, world: int) -> dict[str, torch.Tensor]:
    """A snapshot of step 1 of replicated state written as ``world`` DDP ranks write it: each rank writes the tensors
    the writers' balance gives it (``assign_writers``), in its own object; the writer's own part and merge code."""
    state = _state()
    backend = LocalTier(root)
    names = list(state)
    owners = assign_writers([state[n].numel() * state[n].element_size() for n in names], world)
    parts = []
    for rank in range(world):
        share = stage({"state_dict": {n: state[n] for n, o in zip(names, owners, strict=True) if o == rank}})
        job = SnapshotJob(step=1, epoch=0, shared=share, private=stage({"rank": rank}, "rank"))
        parts.append(write_part(backend, job, rank, "run", 64, CHUNK))
    parts[0]["state"] = {"state_dict": {n: {"$tensor": f"state_dict/{n}"} for n in names}}
    text = json.dumps(merge_parts(parts, 1, 0, world, 64, CHUNK))
    backend.commit(f"{step_dirname(1)}/{MANIFEST_NAME}", text.encode())
    return state


def _read(root, world: int, targets_of=None, tier=LocalTier):
    """Every rank restores the shared state read once; per rank: (state, stats, tier bytes, reader, bytes sent)."""

    def body(comm: ThreadComm):
        backend = tier(root) if comm.rank == 1 else LocalTier(root)
        manifest = read_manifest(backend, 1)
        reader = ReadOnce(comm, "test snapshot")
        reader.start(None)
        stats = ReadStats()
        targets = targets_of(comm.rank) if targets_of is not None else None
        state = read_section(
            backend, manifest, manifest.tensors, manifest.state, targets=targets, stats=stats, shared=reader
        )
        return state, stats, backend.bytes_read, reader, comm.bytes_sent

    return run_ranks(world, body)


def _nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def test_ddp_restore_reads_every_byte_once_and_every_rank_gets_all(tmp_path):
    state = _write(tmp_path, 4)
    out = _read(tmp_path, 4)
    total = _nbytes(state)
    for rank, res in enumerate(out):
        assert not isinstance(res, BaseException), res
        got, stats, read, reader, _sent = res
        for name, t in state.items():
            assert torch.equal(got["state_dict"][name].view(torch.uint8), t.view(torch.uint8)), (rank, name)
        assert stats.bytes_read == read == reader.bytes_read  # this rank's part, as the tier counted it
        assert read + reader.bytes_received == total == stats.bytes_needed
        assert reader.job_bytes_read == total
        # balanced: no rank reads more than its quarter plus a chunk (the tensors are cut at chunk boundaries)
        assert read <= total / 4 + CHUNK, (rank, read, total)
    assert sum(r[2] for r in out) == total  # the tier counted each byte once in the job


def test_resharded_ranks_share_the_chunks_they_both_need(tmp_path):
    """A 2-rank snapshot read into 3 row shards: the chunks at the shard boundaries are needed by two ranks and read
    by one (point-to-point transfers, since not every rank takes part)."""
    state = _write(tmp_path, 2)
    w = state["w"]
    boxes = shard_boxes(tuple(w.shape), (3,), [("shard", 0)])

    def targets(rank: int):
        box = boxes[rank]
        return {"state_dict/w": ShardTarget(box, torch.full(box.shape, -1.0))}

    out = _read(tmp_path, 3, targets)
    per_rank_needed = []
    for rank, res in enumerate(out):
        assert not isinstance(res, BaseException), res
        got, stats, read, reader, _sent = res
        assert torch.equal(got["state_dict"]["w"], w[boxes[rank].slices()]), rank
        assert torch.equal(got["state_dict"]["b"], state["b"])
        per_rank_needed.append(stats.bytes_read + reader.bytes_received)
        assert stats.bytes_read == read
    alone = sum(per_rank_needed)  # what the ranks would have read each on its own
    assert sum(r[2] for r in out) < alone
    assert sum(r[2] for r in out) == out[0][3].job_bytes_read
    assert any(r[3].bytes_received for r in out)


def test_a_corrupted_part_fails_every_rank_with_the_same_error(tmp_path):
    _write(tmp_path, 4)
    manifest = read_manifest(LocalTier(tmp_path), 1)
    frag = next(t for t in manifest.tensors if t.name == "state_dict/w").fragments[0]
    path = tmp_path / step_dirname(1) / frag.object
    data = bytearray(path.read_bytes())
    data[frag.offset + 5 * CHUNK + 3] ^= 0x40  # one flipped bit in the 6th chunk of w
    path.write_bytes(bytes(data))
    out = _read(tmp_path, 4)
    assert all(isinstance(e, SnapshotError) for e in out), out
    messages = {str(e) for e in out}
    assert len(messages) == 1, messages  # the same line on every rank
    (message,) = messages
    assert "could not read their parts of the test snapshot" in message and "checksum mismatch" in message
    assert message.count("checksum mismatch") == 1  # only the rank that read that chunk found it


def test_a_bug_on_one_rank_is_raised_there_and_the_others_do_not_wait(tmp_path):
    _write(tmp_path, 4)

    class Buggy(LocalTier):
        def read_into(self, key, offset, out):
            raise RuntimeError("a bug in the tier")

    out = _read(tmp_path, 4, tier=Buggy)
    assert isinstance(out[1], RuntimeError), out
    assert all(
        isinstance(e, SnapshotError) and "on rank 1: RuntimeError: a bug in the tier" in str(e)
        for e in out[:1] + out[2:]
    ), out


def test_a_rank_that_could_not_prepare_fails_every_rank(tmp_path):
    def body(comm: ThreadComm):
        ReadOnce(comm, "test snapshot").start(ValueError("no manifest here") if comm.rank == 2 else None)

    out = run_ranks(3, body)
    assert isinstance(out[2], ValueError)
    assert all(isinstance(e, SnapshotError) and "failed on another rank" in str(e) for e in out[:2] + out[3:]), out


# ---------------------------------------------------------------------------------------------------- the plan


def _chunks(obj: str, n: int, size: int = 10) -> list[tuple[str, int, int]]:
    return [(obj, i * size, size) for i in range(n)]


def test_plan_replicated_needs_each_chunk_read_once_balanced():
    needs = [_chunks("a", 40) + _chunks("b", 8)] * 4
    plan = plan_shared_reads(needs, batch_bytes=50)
    read = [c for b in plan for c in b.chunks]
    assert sorted(read) == sorted(needs[0])  # every chunk once
    per_rank = [sum(b.nbytes for b in plan if b.reader == r) for r in range(4)]
    assert per_rank == [120] * 4
    assert all(b.receivers == tuple(r for r in range(4) if r != b.reader) for b in plan)
    assert all(b.nbytes <= 50 for b in plan)
    assert plan == plan_shared_reads([list(reversed(n)) for n in needs], batch_bytes=50)  # order-free


def test_plan_disjoint_needs_read_as_alone():
    needs = [_chunks(f"rank{r}", 5) for r in range(3)]
    plan = plan_shared_reads(needs)
    assert [(b.reader, b.receivers, list(b.chunks)) for b in plan] == [(r, (), needs[r]) for r in range(3)]


def test_plan_partial_overlaps_go_to_the_ranks_that_need_them():
    shared = _chunks("s", 4)
    needs = [_chunks("x", 10) + shared, shared, []]
    plan = plan_shared_reads(needs)
    for b in plan:
        for c in b.chunks:
            need = {r for r, n in enumerate(needs) if c in n}
            assert {b.reader, *b.receivers} == need
    # rank 0 already reads 100 bytes of its own: rank 1 reads the shared ones
    assert all(b.reader == 1 for b in plan if b.receivers)


@pytest.mark.parametrize("world", [1, 2, 5])
def test_plan_box_shaped_overlaps(world):
    needs = [[("o", (r * 7 + i) * 10, 10) for i in range(12)] for r in range(world)]
    plan = plan_shared_reads(needs)
    chunks = [c for b in plan for c in b.chunks]
    assert len(chunks) == len(set(chunks)) == len({c for n in needs for c in n})
