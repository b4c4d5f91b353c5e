"""Every write the callback makes into Lightning's private state, and the registry that undoes them.

Lightning has no hook at the points a snapshot must be taken and restored at (right before a batch is fetched,
between epochs, when the training loop ends, when a train loader is made), and a resumed run's loops must be told
where they are. The callback does all of that through this module (``SnapshotCallback.setup``, ``on_fit_start`` and
``on_train_start`` call it): the methods it overrides on Lightning's objects are installed through one
:class:`Patches` registry per fit, which undoes every one of them at ``teardown`` and after an exception (so no
patched attribute outlives the fit), and the counters and flags it sets are set here, next to why.
Each entry says, next to the write, which behaviour of Lightning it relies on; ``tests/test_patches.py`` checks that
no overridden method outlives a fit, whether it ended normally or raised.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from lightning.pytorch.loops.loop import _Loop  # noqa: PLC2701

__all__ = [
    "Patches",
    "install_fit_hooks",
    "make_loaders_at_epoch",
    "own_signals",
    "resume_loops",
    "shift_batch_counters",
    "watch_validation",
]


class Patches:
    """The methods overridden on Lightning's objects during one fit (instance attributes that shadow the class's)."""

    def __init__(self) -> None:
        self._installed: list[tuple[Any, str, Callable[..., Any]]] = []

    def __bool__(self) -> bool:
        return bool(self._installed)

    def install(self, owner: Any, name: str, replacement: Callable[..., Any], *, once: bool = False) -> None:
        """Override ``owner.name`` with ``replacement`` until :meth:`undo_all` (``once``: until its first call,
        which removes it before it runs)."""
        if once:
            inner = replacement

            @functools.wraps(inner)
            def replacement(*args: Any, **kwargs: Any) -> Any:
                self.undo(owner, name)
                return inner(*args, **kwargs)

        setattr(owner, name, replacement)
        self._installed.append((owner, name, replacement))

    def undo(self, owner: Any, name: str) -> None:
        """Remove the override of ``owner.name`` (the class's method shows through again)."""
        for i, (o, n, fn) in enumerate(self._installed):
            if o is owner and n == name:
                if o.__dict__.get(n) is fn:
                    del o.__dict__[n]
                del self._installed[i]
                return

    def undo_all(self) -> None:
        """Remove every override still installed (newest first)."""
        while self._installed:
            owner, name, _ = self._installed[-1]
            self.undo(owner, name)


def install_fit_hooks(
    patches: Patches,
    trainer: Any,
    *,
    hooked: Callable[[], bool],
    on_train_loader: Callable[[object], None],
    before_fetch: Callable[[], None],
    between_epochs: Callable[[], None],
    end_of_fit: Callable[[], None],
) -> None:
    """The points a snapshot is taken at, which Lightning has no hooks for (each runs only while the trainer's loops
    run with the callback, ``hooked()``: a tuner such as ``LearningRateFinder`` runs them with its own callbacks).

    - ``on_train_loader(loader)``: a train loader as the strategy processes it, before its first iterator exists;
    - ``before_fetch()``: right before the training loop fetches a batch (the epoch loop gives ``_on_before_fetch``
      to its data fetcher as the profiler's start), after validation, epoch end and what reacts to them;
    - ``between_epochs()``: after an epoch's end (validation, epoch-end callbacks and scheduler steps, logged epoch
      metrics), before the next epoch's start hooks (the fit loop's ``on_advance_start``);
    - ``end_of_fit()``: when the training loop ends, before the ``on_train_end`` hooks (``on_run_end``).
    """
    strategy = trainer.strategy
    process = strategy.process_dataloader

    def process_dataloader(dataloader: object) -> object:
        dataloader = process(dataloader)
        if trainer.training and hooked():
            on_train_loader(dataloader)
        return dataloader

    patches.install(strategy, "process_dataloader", process_dataloader)
    for owner, name, hook in (
        (trainer.fit_loop.epoch_loop, "_on_before_fetch", before_fetch),
        (trainer.fit_loop, "on_advance_start", between_epochs),
        (trainer.fit_loop, "on_run_end", end_of_fit),
    ):
        patches.install(owner, name, _first(hook, getattr(owner, name), hooked))


def _first(hook: Callable[[], None], original: Callable[[], None], hooked: Callable[[], bool]) -> Callable[[], None]:
    """``original`` (a Lightning loop method taking no argument), with ``hook`` run right before it while
    ``hooked()``."""

    def run() -> None:
        if hooked():
            hook()
        original()

    return run


def make_loaders_at_epoch(
    patches: Patches, trainer: Any, made: int, hooked: Callable[[], bool], making: Callable[[int | None], None]
) -> None:
    """The fit loop's next ``setup_data`` makes the train loaders as at epoch ``made`` (Lightning calls
    ``train_dataloader()`` with ``trainer.current_epoch`` and counts the reloads of
    ``reload_dataloaders_every_n_epochs`` from the epoch it made them at); ``making(epoch)`` is told the real epoch
    while it does (None after). One shot; a tuner's own run of the loops is left alone."""
    fit_loop = trainer.fit_loop
    original = fit_loop.setup_data

    def setup_data() -> None:
        if not hooked():  # (a tuner's own run of the loops)
            original()
            return
        patches.undo(fit_loop, "setup_data")
        progress = fit_loop.epoch_progress.current
        epoch = progress.completed  # (trainer.current_epoch)
        making(epoch)
        progress.completed = made
        try:
            original()  # (sets _last_train_dl_reload_epoch to the epoch it made them at)
        finally:
            progress.completed = epoch
            making(None)

    patches.install(fit_loop, "setup_data", setup_data)


def resume_loops(
    patches: Patches, trainer: Any, boundary: bool, validate_first: Callable[[], None] | None = None
) -> None:
    """After a restore, at ``on_train_start``: Lightning's restart logic is made for checkpoints taken inside a step
    (at ``on_train_batch_end``, on validation end, at epoch end); a snapshot is the state right before the next batch
    is fetched, so the restored loops must neither repeat nor skip anything from there.

    ``boundary``: the snapshot ended an epoch, and the next one starts as in a run that never stopped (its start
    hooks, a new loader iterator, counters from zero). Otherwise the run continues within the epoch.
    ``validate_first``: the snapshot was taken as the validation after its step started, and a preemption abandoned
    that validation: the resumed epoch loop runs the rest of that step first (``validate_first()`` puts the RNG back
    as it was then; then the validation, which Lightning decides to run from counters that are as they were, the
    plateau schedulers and the step's logging), before it fetches the next batch.
    """
    fit_loop = trainer.fit_loop
    epoch_loop = fit_loop.epoch_loop
    if boundary:
        _Loop.restarting.fset(fit_loop, False)  # type: ignore[attr-defined]  # mypy does not type a property's fset
        fit_loop._resuming_from_checkpoint = False
        return
    # Within an epoch. The fit loop would stay "restarting" until the epoch ends and then skip the epoch-end
    # plateau scheduler step; its start hooks ran before the snapshot, which its counters already say.
    fit_loop._restarting = False
    # The epoch loop keeps its counters while it resets (restarting), and must then not take its restart path on the
    # first batch: that would re-run or fast-forward step N's validation, which the snapshot holds done.
    original = epoch_loop.on_run_start

    def on_run_start(data_fetcher: Any) -> None:
        original(data_fetcher)
        epoch_loop._restarting = False
        if validate_first is not None:
            validate_first()
            # the end of the step that was validating (``on_advance_end``), with its validation decided as then
            patches.install(epoch_loop, "_should_check_val_fx", lambda fetcher: True, once=True)
            # (a new validation, as the epoch loop's advance would set before it trains: the restored validation
            # loop's counters are those of the previous validation, which it must not continue)
            epoch_loop.val_loop.restarting = False
            epoch_loop.on_advance_end(data_fetcher)

    patches.install(epoch_loop, "on_run_start", on_run_start, once=True)


def watch_validation(
    patches: Patches,
    trainer: Any,
    *,
    hooked: Callable[[], bool],
    starting: Callable[[], None],
    ended: Callable[[], None],
    abandon: Callable[[], bool],
    agree: Callable[[], None],
) -> None:
    """The points of a validation a preemption needs (also the sanity check's; each only while ``hooked()``):

    - ``starting()`` right before the validation loop runs (``val_loop.run``, before it makes its iterators and
      calls any hook) and ``ended()`` after it, whether it ended or raised;
    - before each validation batch: when ``abandon()`` is true the rest of the batches is skipped (a
      ``StopIteration`` inside the batch's step is how the loop itself ends on an exhausted loader);
    - ``agree()`` once the validation's epoch-end hooks ran (every rank reaches it, however many batches it ran;
      hooks that swapped averaged weights in have swapped them back) and before its metrics are logged and its end
      hooks run (``ModelCheckpoint``, ``EarlyStopping``): it raises to stop there.
    """
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    run, step, epoch_end = val_loop.run, val_loop._evaluation_step, val_loop._on_evaluation_epoch_end

    def run_watched() -> Any:
        if not hooked():
            return run()
        starting()
        try:
            return run()
        finally:
            ended()

    def evaluation_step(*args: Any, **kwargs: Any) -> Any:
        if hooked() and abandon():
            raise StopIteration
        return step(*args, **kwargs)

    def on_evaluation_epoch_end(*args: Any, **kwargs: Any) -> Any:
        result = epoch_end(*args, **kwargs)
        if hooked():
            agree()
        return result

    patches.install(val_loop, "run", run_watched)
    patches.install(val_loop, "_evaluation_step", evaluation_step)
    patches.install(val_loop, "_on_evaluation_epoch_end", on_evaluation_epoch_end)


def shift_batch_counters(trainer: Any, consumed: int) -> None:
    """Make the restored epoch count ``consumed`` batches as done, so that the batches left in this rank's stream end
    the epoch exactly at the loader's length (after a change of the number of data-parallel ranks the same global
    sample is a different batch index). Only the epoch's ``current`` counters move, all by the same amount, so
    Lightning's restart repair (``completed += 1``) still applies; totals are untouched."""
    current = trainer.fit_loop.epoch_loop.batch_progress.current
    delta = consumed - current.ready
    if delta:
        current.ready += delta
        current.started += delta
        current.processed += delta
        current.completed += delta


def own_signals(patches: Patches, trainer: Any, install: Callable[[], bool], sigterm: bool) -> None:
    """Lightning registers its signal handlers when training is about to run (``_SignalConnector
    .register_signal_handlers``, after ``on_fit_start``, recording the handlers before it to give back at its
    teardown): ``install()`` (which takes the preemption signals over) runs right after it. With SIGTERM owned, the
    epoch loop's per-batch broadcast of rank 0's SIGTERM flag (``_broadcast_sigterm_tensor``, a collective and, on a
    GPU, a device synchronisation per batch) has nothing to broadcast any more (Lightning's flag is never set): it is
    skipped for the fit."""
    connector = trainer._signal_connector
    original = connector.register_signal_handlers

    def register_signal_handlers() -> None:
        original()
        install()

    patches.install(connector, "register_signal_handlers", register_signal_handlers)
    epoch_loop = trainer.fit_loop.epoch_loop
    if sigterm and hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
        patches.install(epoch_loop, "_broadcast_sigterm_tensor", lambda: None)
