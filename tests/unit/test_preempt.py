"""The preemption parts alone: the signals option, the handler that only records, the ranks' agreement (ranks as
threads over the fake communicator), and loader workers that a signal to the process group does not kill."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from thread_comm import ThreadComm, run_ranks
from torch.utils.data import dataloader

from lightning_snapshot.dist.comm import LocalComm
from lightning_snapshot.dist.preempt import Preemption, parse_signals
from lightning_snapshot.errors import ConfigError, Preempted


def test_signals_option_takes_names_numbers_and_lists_and_refuses_the_rest():
    assert parse_signals("SIGTERM") == (signal.SIGTERM,)
    assert parse_signals(["TERM", "usr1", 15]) == (signal.SIGTERM, signal.SIGUSR1)
    assert parse_signals([]) == () and parse_signals(None) == ()
    with pytest.raises(ConfigError, match="SIGKILL cannot be a preemption signal"):
        parse_signals("SIGKILL")
    with pytest.raises(ConfigError, match="'SIGNOPE' is not a signal of this platform"):
        parse_signals(["SIGTERM", "SIGNOPE"])
    with pytest.raises(ConfigError, match="not a signal name or number"):
        parse_signals([1.5])


def test_preempted_exits_with_128_plus_the_signal():
    e = Preempted(signal.SIGTERM, 24, True)
    assert isinstance(e, SystemExit) and e.code == 143 and "step 24" in str(e)


def test_the_handler_records_and_the_previous_handler_comes_back():
    seen = []
    previous = signal.signal(signal.SIGUSR2, lambda *a: seen.append(a))
    try:
        p = Preemption([signal.SIGUSR2], LocalComm())
        assert p.install()
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGUSR2)  # (a second one changes nothing)
        signum, when = Preemption.received()
        assert signum == signal.SIGUSR2 and 0 < time.monotonic() - when < 5 and not seen
        assert p.poll(3) == signal.SIGUSR2 and p.agreed == signal.SIGUSR2
        p.restore()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert len(seen) == 1  # the user's handler is back
        assert dataloader._MultiProcessingDataLoaderIter.__init__.__name__ == "__init__"
        assert not hasattr(dataloader._MultiProcessingDataLoaderIter.__init__, "__wrapped__")
    finally:
        signal.signal(signal.SIGUSR2, previous)


class _Rank(Preemption):
    """A rank (a thread) whose own received signal is ``local`` (threads share the process's handler slot)."""

    local = 0

    def _local(self) -> int:
        return self.local


def test_any_ranks_signal_stops_every_rank_at_the_same_step():
    """Four ranks poll once per step; rank 2 alone has a signal from step 5 on: every rank learns it at step 6 (each
    poll reads the all-reduce the previous one started, so that no rank waits for it). A second poll at the same
    step is no collective and answers 0; after the agreement nothing is polled again."""

    def body(comm: ThreadComm) -> list[int]:
        p = _Rank([signal.SIGTERM], comm)
        p._previous = {signal.SIGTERM: signal.SIG_DFL}  # (owned, without touching this process's handlers)
        answers = []
        for step in range(1, 8):
            p.local = signal.SIGTERM if comm.rank == 2 and step >= 5 else 0
            answers += [p.poll(step), p.poll(step)]
        return answers

    for answers in run_ranks(4, body):
        assert answers == [0, 0] * 5 + [signal.SIGTERM, 0] + [0, 0], answers


def test_without_the_signals_owned_nothing_is_polled():
    p = _Rank([signal.SIGTERM], LocalComm())
    p.local = signal.SIGTERM
    assert p.poll(1) == 0  # (not installed: Lightning's own handling)


_WORKERS_SCRIPT = r"""
import os, signal, subprocess, sys, time
from torch.utils.data import DataLoader
from torch.utils.data._utils.signal_handling import _remove_worker_pids
from lightning_snapshot.dist.comm import LocalComm
from lightning_snapshot.dist.preempt import Preemption

if __name__ == "__main__":
    p = Preemption([signal.SIGTERM], LocalComm())
    assert p.install()
    for ctx in sys.argv[1:]:
        it = iter(DataLoader(list(range(64)), batch_size=4, num_workers=2, multiprocessing_context=ctx))
        next(it), next(it)  # (a batch from each worker: both have started; spawned ones are guarded from then on)
        for w in it._workers:  # SIGTERM from another process (the cluster, torchrun's killpg)
            subprocess.run(["kill", "-TERM", str(w.pid)], check=True)
        time.sleep(0.5)
        assert all(w.is_alive() for w in it._workers), ctx
        assert sum(len(b) for b in it) == 56, ctx  # (the rest of the epoch)
        w = it._workers[0] if it._workers else None
        it2 = iter(DataLoader(list(range(64)), batch_size=4, num_workers=2, multiprocessing_context=ctx))
        next(it2)
        # the main process can still stop one, as the iterator's shutdown does (its pids first out of torch's SIGCHLD
        # watch, which would otherwise raise in this process for a worker that ended by a signal)
        _remove_worker_pids(id(it2))
        it2._workers[0].terminate()
        it2._workers[0].join(10)
        assert not it2._workers[0].is_alive(), ctx
        print("OK", ctx, flush=True)
    # a live iterator at exit: multiprocessing terminates its workers, which must not hang the exit
    it3 = iter(DataLoader(list(range(64)), batch_size=4, num_workers=2))
    next(it3)
"""


@pytest.mark.parametrize("contexts", [["fork"], ["spawn"]])
def test_loader_workers_survive_a_signal_to_the_group_and_can_still_be_stopped(tmp_path, contexts):
    script = tmp_path / "workers.py"
    script.write_text(_WORKERS_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), *contexts], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == [w for c in contexts for w in ("OK", c)], proc.stdout
