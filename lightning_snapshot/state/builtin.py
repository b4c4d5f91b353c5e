"""The kinds of training state a snapshot holds besides the weights, the optimizers and Lightning's own checkpoint
state: each a registered :class:`~lightning_snapshot.state.parts.Part` (a name, capture, restore, the phase its restore
is
applied at, per rank or shared), in :data:`REGISTRY`, in order.

Adding a kind of state touches this file only: one :func:`register` call (or a call from the user's own code, before
``fit``; see ``docs/architecture.md``, "Adding a kind of state"). The engine iterates over the registry: the pipeline
captures it at each snapshot (:meth:`~lightning_snapshot.state.parts.Registry.capture`), the Restorer and the callback's
hooks restore it phase by phase (:meth:`~lightning_snapshot.state.parts.Registry.restore`).

The parts map onto the keys snapshots always had (the format does not change): per rank ``rng``, ``loaders`` and
``ddp_layout`` of each rank's section; shared the callback states (``callbacks`` of the late state) and the fit state
(``lightning_snapshot/fit_state/<name>`` of the late state: what Lightning's checkpoints leave out, see
:mod:`lightning_snapshot.state.fit_state`).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

from lightning_snapshot import data as _data
from lightning_snapshot.data.rng import capture_rng, restore_rng
from lightning_snapshot.dist.agree import agree_on
from lightning_snapshot.errors import SnapshotError
from lightning_snapshot.state import averaging as _averaging
from lightning_snapshot.state import fit_checkpoints as _ckpts
from lightning_snapshot.state import fit_metrics as _metrics
from lightning_snapshot.state import fit_state as _fit
from lightning_snapshot.state import patches as _patches
from lightning_snapshot.state.capture import capture_late
from lightning_snapshot.state.ddp_layout import DDP_LAYOUT_ENV, apply_layout, capture_layout, check_layout, is_ddp
from lightning_snapshot.state.ddp_layout import enabled as ddp_layout_enabled
from lightning_snapshot.state.parts import CaptureContext, Part, Phase, Registry, RestoreContext

__all__ = ["REGISTRY", "capture_section", "capture_tensor_parts", "register", "unregister"]

log = logging.getLogger(__name__)

#: The registered parts, in order (keys of a rank's section and of the fit state in that order).
REGISTRY = Registry()
register = REGISTRY.register
unregister = REGISTRY.unregister


def _walk(ctx: CaptureContext) -> _fit.Walk:
    """The module's walk for this capture, kept from one snapshot to the next while the capture plan holds."""
    walk = ctx.cache.get("walk")
    if walk is None:
        structure = ctx.memo.setdefault("structure", _fit.Structure())
        walk = ctx.cache["walk"] = structure.get(ctx.pl_module, ctx.token)
    return walk


def capture_section(
    trainer: Any,
    consumed: int,
    token: object | None,
    fetch_states: Callable[[int], Any],
    memo: dict[str, Any],
    validation_pending: bool = False,
) -> dict[str, Any]:
    """This rank's section of the snapshot: the late state (loops, schedulers, ... and the shared state parts) and the
    per-rank state parts. ``consumed``: the epoch's batches consumed; ``token``: the capture plan's token (it vouches
    for the module's structure only once the late check confirmed it: see ``SnapshotPipeline._finish``);
    ``fetch_states``: the train loaders' states recorded before a fetch; ``memo``: the parts' memory for the fit;
    ``validation_pending``: taken as a validation starts (the resumed run validates again before it trains on)."""
    epoch_progress = trainer.fit_loop.epoch_progress.current
    ended = epoch_progress.ready == epoch_progress.processed  # the fit loop counted the epoch as finished
    batches = trainer.fit_loop.epoch_loop.batch_progress
    # max_steps can end training inside an epoch, and Lightning then counts that epoch as finished too: the
    # snapshot records it as unfinished, so that a longer run continues it from the next batch
    unfinished = ended and not batches.is_last_batch and consumed < trainer.num_training_batches
    boundary = ended and not unfinished  # training ended with an epoch: the next starts from its beginning
    epoch = trainer.current_epoch - 1 if unfinished else trainer.current_epoch
    # a loader fetched ahead: its state before the first batch this snapshot has not consumed (fetch indices
    # count the epoch's batches, as the loop does)
    loader_states = None if boundary else fetch_states(consumed)
    pl_module = trainer.lightning_module
    ctx = CaptureContext(trainer, pl_module, consumed=consumed, epoch=epoch, boundary=boundary, token=token, memo=memo)
    ctx.validation_pending = validation_pending

    def late(parts: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        state = capture_late(trainer, pl_module, loader_states, parts, REGISTRY.replaces_hooks)
        if unfinished:
            state["epoch"] = epoch
            for counters in state["loops"]["fit_loop"]["epoch_progress"].values():
                counters["processed"] -= 1
                counters["completed"] -= 1
        return state

    section: dict[str, Any] = REGISTRY.capture(ctx, late)
    return section


def capture_tensor_parts(trainer: Any, memo: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """The tensor parts' live state and their stable tensors (:meth:`~lightning_snapshot.state.parts.Registry.
    capture_tensors`), for the weights' stager (at each snapshot) and a restore's targets. ``memo``: the parts' memory
    for the fit."""
    trainer_module = trainer.lightning_module
    ctx = CaptureContext(
        trainer, trainer_module, consumed=0, epoch=trainer.current_epoch, boundary=False, token=None, memo=memo
    )
    return REGISTRY.capture_tensors(ctx)


# ------------------------------------------------------------------------------------------------- per rank
def _restore_rng(ctx: RestoreContext, state: Any) -> None:
    if state is not None:
        restore_rng(state)


def _capture_loaders(ctx: CaptureContext) -> list[Any]:
    """Each train loader's position (the batches of the epoch consumed; at an epoch boundary, the epoch's end)."""
    trainer = ctx.trainer
    # (at an epoch boundary only persistent loader workers carry something into the next epoch: their RNG)
    train_loaders = _data.flatten_loaders(trainer.train_dataloader)
    # several loaders (a CombinedLoader) of a known length, fetched as they are consumed: each is at its own
    # batch (a shorter one starts again within the epoch, or ran out)
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    own = len(train_loaders) > 1 and getattr(fetcher, "length", None) is not None
    consumed = ctx.consumed
    return [
        _data.position(dl, ctx.epoch, 0, ended=True)
        if ctx.boundary
        else _data.position(dl, ctx.epoch, _data.own_batches(dl, consumed) if own else consumed)
        for dl in train_loaders
    ]


def _restore_loaders(ctx: RestoreContext, positions: Any) -> None:
    """Hand the positions to the fit's loaders, which put them back as Lightning makes the loaders."""
    loaders = list(positions) if isinstance(positions, list) else []
    if loaders and all(p is not None for p in loaders):
        # Lightning cannot see that our sampler restores the position of plain DataLoaders, and would warn
        warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")
    ctx.loaders.resume(ctx.resumed, loaders, ctx.exact)


def _capture_ddp_layout(ctx: CaptureContext) -> dict[str, Any] | None:
    """DDP's rebuilt gradient-bucket layout (plain data), or None (not DDP, not rebuilt, or turned off).

    Every rank calls this at the same point on the training thread: when the rebuild is still pending (the
    snapshot of a process's first step) it is done here, with DDP's own broadcast from rank 0, exactly as the
    next forward would do it.
    """
    model = ctx.trainer.strategy.model
    if not is_ddp(model) or not ddp_layout_enabled():
        return None
    try:
        return capture_layout(model, rebuild_pending=True)
    except (AttributeError, TypeError, RuntimeError) as e:  # torch's private internals changed
        if not ctx.memo.get("warned_layout"):
            ctx.memo["warned_layout"] = True
            warnings.warn(
                f"lightning-snapshot: cannot read DDP's gradient-bucket layout with this torch"
                f" ({type(e).__name__}: {e}); snapshots are taken without it, and a resume with 3 or"
                f" more ranks will not be bitwise identical to an uninterrupted run",
                stacklevel=2,
            )
        return None


def _restore_ddp_layout(ctx: RestoreContext, layout: Any) -> None:
    """Give DDP the gradient-bucket layout the snapshot's process all-reduced with (see ``ddp_layout``).

    Called on every rank together in ``on_fit_start``: the strategy has wrapped the model in DDP and nothing has
    run a forward through it yet (the sanity check and training come later). The layout is untrusted input: it
    is applied only when every rank holds the same layout and it fits the live DDP module (the parameters that
    require grad, their sizes and dtypes); otherwise a warning names why and the resume goes on without it (the
    weights and all other state are restored either way; only the float summation order of the next
    all-reduces may differ from an uninterrupted run). Only at the same world size (after a change of the number of
    processes there is no layout) and only into DDP (another strategy has no buckets).
    """
    comm, where = ctx.comm, ctx.where
    model = ctx.trainer.strategy.model
    if not is_ddp(model) or comm.world_size < 2:
        return
    if not ddp_layout_enabled():
        layout = None
    problem = None
    try:
        check_layout(model, layout)
    except ValueError as e:
        problem = str(e)
    except (AttributeError, TypeError, RuntimeError) as e:  # torch's private internals changed
        problem = f"this torch is not supported ({type(e).__name__}: {e})"
    first = comm.broadcast(layout)
    if problem is None and layout != first:
        problem = f"rank {comm.rank} holds another layout than rank 0"
    none_stored, all_fit = agree_on(
        comm, f"the DDP layout of the {where}", flags=[layout is None, problem is None]
    ).flags
    if none_stored:  # taken before this feature, without DDP, or where DDP never rebuilds; or turned off
        return
    if not all_fit:
        warnings.warn(
            f"lightning-snapshot: the {where} holds a DDP gradient-bucket layout that is not applied"
            f" ({problem or 'it does not fit on another rank'}); the resume goes on without it, so"
            " with 3 or more ranks the next steps may differ in the last bits from an uninterrupted"
            " run",
            stacklevel=2,
        )
        return
    applied = agree_on(comm, f"giving DDP the layout of the {where}", lambda: apply_layout(model, layout))
    if not applied.ok:
        raise SnapshotError(
            f"giving DDP the gradient-bucket layout of the {where} failed ({applied.text}); set"
            f" {DDP_LAYOUT_ENV}=0 to resume without it (with 3 or more ranks not bitwise identical to an"
            " uninterrupted run)"
        ) from applied.error
    log.debug("lightning-snapshot: DDP gradient-bucket layout restored: %s", first["buckets"])


# ------------------------------------------------------------------------------------------------- shared
def _capture_callbacks(ctx: CaptureContext) -> dict[str, Any]:
    """Every callback's ``state_dict`` (those that hold something), by state key."""
    out: dict[str, Any] = {}
    for cb in ctx.trainer.callbacks:
        state = cb.state_dict()
        if state:
            out[cb.state_key] = state
    return out


def _mid(ctx: RestoreContext) -> bool:
    return ctx.resumed == "mid"


def _made_at(ctx: RestoreContext, made: Any) -> None:
    """A resumed run makes its train loaders as the interrupted run last made them (at the epoch it last made them
    at: a curriculum that reads the epoch; reload_dataloaders_every_n_epochs at the same epochs)."""
    trainer = ctx.trainer
    if isinstance(made, int) and not isinstance(made, bool) and 0 <= made < trainer.current_epoch:
        _patches.make_loaders_at_epoch(ctx.patches, trainer, made, ctx.hooked, ctx.loaders.set_making_epoch)


def _validation_pending(ctx: RestoreContext, pending: Any) -> None:
    ctx.validation_pending = pending is True


# ------------------------------------------------------------------------------------------------- the registry
# per rank, in the order of a rank's section: RNG, loader positions (then the late state), DDP's bucket layout
register(Part("rng", lambda ctx: capture_rng(), _restore_rng, Phase.FIRST_FETCH, per_rank=True))
register(Part("loaders", _capture_loaders, _restore_loaders, Phase.FIT_START, per_rank=True, resharded=True))
# shared: the fit state (lightning_snapshot/fit_state/<name> of the late state), in its keys' order
register(
    Part(
        "param_groups",  # replace the early optimizer state's groups before anything is checked or applied
        lambda ctx: _fit.optimizer_groups(ctx.trainer, _walk(ctx)),
        lambda ctx, v: _fit.merge_param_groups(ctx.shared, ctx.where),
        Phase.READ,
    )
)
register(
    Part(
        "trainable",
        lambda ctx: _fit.trainable_flags(_walk(ctx)),
        lambda ctx, v: _fit.restore_trainable(ctx.pl_module, {"trainable": v}),
        Phase.LOAD,
    )
)
register(
    Part(
        "track_running_stats",
        lambda ctx: _fit.running_stats_tracking(_walk(ctx)),
        lambda ctx, v: _fit.restore_trainable(ctx.pl_module, {"track_running_stats": v}),
        Phase.LOAD,
    )
)
register(
    Part(
        "accumulate_grad_batches",  # (within an epoch: GradientAccumulationScheduler sets it at its start)
        lambda ctx: int(ctx.trainer.accumulate_grad_batches),
        lambda ctx, v: _metrics.restore_in_epoch(ctx.trainer, {"accumulate_grad_batches": v}) if _mid(ctx) else None,
        Phase.EPOCH,
    )
)
register(
    Part(
        "train_results",
        lambda ctx: _metrics.train_results(ctx.trainer),
        lambda ctx, v: _metrics.restore_in_epoch(ctx.trainer, {"train_results": v}) if _mid(ctx) else None,
        Phase.EPOCH,
    )
)
register(
    Part(
        "logger_connector",
        lambda ctx: _metrics.logger_connector_state(ctx.trainer),
        lambda ctx, v: _metrics.restore_in_epoch(ctx.trainer, {"logger_connector": v}) if _mid(ctx) else None,
        Phase.EPOCH,
    )
)
register(
    Part(
        "checkpoint_files",
        lambda ctx: _ckpts.checkpoint_files(ctx.trainer),
        lambda ctx, v: _ckpts.prune_checkpoints(ctx.trainer, {"checkpoint_files": v}, ctx.step),
        Phase.LOADED,
    )
)
register(
    Part(
        "checkpoint_saves",  # ModelCheckpoint's record of its last save
        lambda ctx: _ckpts.checkpoint_saves(ctx.trainer),
        lambda ctx, v: _ckpts.restore_checkpoint_saves(ctx.trainer, {"checkpoint_saves": v}),
        Phase.LOADED,
    )
)
register(
    Part(
        "grads",  # (only before StochasticWeightAveraging's BatchNorm-update epoch, which starts at a boundary)
        lambda ctx: _fit.reused_grads(ctx.trainer, ctx.pl_module),
        lambda ctx, v: _fit.restore_grads(ctx.pl_module, {"grads": v}) if ctx.resumed == "boundary" else None,
        Phase.EPOCH,
    )
)
register(
    Part(
        "metrics",  # torchmetrics.Metric states
        lambda ctx: _metrics.metric_states(_walk(ctx).metrics),
        lambda ctx, v: _metrics.restore_metrics(ctx.pl_module, {"metrics": v}),
        Phase.LOAD,
    )
)
register(Part("train_dl_epoch", lambda ctx: _fit.train_dl_epoch(ctx.trainer), _made_at, Phase.FIT_START))
register(
    Part(
        "validation_pending",  # taken as a validation started, which a preemption abandoned: the resume runs it again
        lambda ctx: True if ctx.validation_pending else None,
        _validation_pending,
        Phase.FIT_START,
    )
)
register(
    Part(
        "stopped",
        lambda ctx: _fit.stop_limits(ctx.trainer) if ctx.trainer.should_stop else None,
        lambda ctx, v: _fit.restore_stop(ctx.trainer, {"stopped": v}, ctx.trainer.global_step),
        Phase.TRAIN_START,
    )
)
register(
    Part(
        "generators",  # the model's own torch.Generator objects
        lambda ctx: _fit.module_generators(_walk(ctx), ctx.memo.setdefault("structure", _fit.Structure())),
        lambda ctx, v: _fit.restore_generators(ctx.pl_module, {"generators": v}),
        Phase.TRAIN_START,
    )
)
# shared: the callbacks' states (``callbacks`` of the late state), loaded before any callback's on_fit_start
register(
    Part(
        "callbacks",
        _capture_callbacks,
        lambda ctx, v: _ckpts.load_callback_states(ctx.trainer, v, exclude=ctx.owner),
        Phase.SETUP,
        path=("callbacks",),
    )
)
# tensors: the averaged model of Lightning's WeightAveraging callbacks (EMAWeightAveraging), on the weights' path
register(
    Part(
        "weight_averaging",
        _averaging.capture,
        _averaging.restore,
        Phase.LOAD,
        tensors=True,
        stable=_averaging.stable,
        hooks=_averaging.hooks,
    )
)
# per rank: the averaged model's buffers (each rank's own: see state/averaging.py), after the part above
register(
    Part(
        "weight_averaging_buffers",
        _averaging.capture_buffers,
        _averaging.restore_buffers,
        Phase.LOAD,
        per_rank=True,
        resharded=True,
    )
)
# per rank, after the late state
register(Part("ddp_layout", _capture_ddp_layout, _restore_ddp_layout, Phase.LOADED, per_rank=True))
