"""The user's ``state`` dict of a Fabric loop, as a snapshot holds it: what each entry is, the trees staged (the
shared one, copied in the background; this rank's own), the targets a restore reads into, and putting a snapshot back
into ``state`` in place.

Used by :class:`~lightning_snapshot.fabric.snapshots.FabricSnapshots` only (it decides when; this module says what).
Layout of a snapshot's trees: ``docs/fabric.md`` ("What is captured").
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import MutableMapping
from typing import Any, cast

import torch

from lightning_snapshot import data as _data
from lightning_snapshot.data.rng import capture_rng, restore_rng
from lightning_snapshot.errors import ConfigError, SnapshotError, StateMismatchError
from lightning_snapshot.format.tree import encode
from lightning_snapshot.staging import is_dtensor
from lightning_snapshot.staging.live import LiveCapture
from lightning_snapshot.state.capture import check_model

__all__ = [
    "FabricSource",
    "apply",
    "inner_loader",
    "module_prefixes",
    "rank_tree",
    "raw_optimizer",
    "read_targets",
    "shared_head",
    "shared_tree",
    "split",
    "split_modules",
]


def raw_optimizer(opt: Any) -> torch.optim.Optimizer:
    """The torch optimizer (Fabric's ``_FabricOptimizer`` wraps it as ``.optimizer``)."""
    inner = getattr(opt, "optimizer", opt)
    return cast("torch.optim.Optimizer", inner if isinstance(inner, torch.optim.Optimizer) else opt)


def inner_loader(loader: Any) -> Any:
    """The torch ``DataLoader`` of a loader from ``fabric.setup_dataloaders`` (or the loader itself)."""
    return getattr(loader, "_dataloader", loader)  # (Fabric's _FabricDataLoader keeps it there)


def _is_loader(value: Any) -> bool:
    return isinstance(inner_loader(value), torch.utils.data.DataLoader)


def split(state: MutableMapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The user's ``state`` by kind: ``modules``, ``optimizers``, ``loaders``, ``objects`` (``state_dict`` and
    ``load_state_dict``) and ``values`` (anything else, stored as it is)."""
    if not isinstance(state, MutableMapping):
        raise ConfigError(f"FabricSnapshots takes the training state as a dict (LitGPT's `state`), got {type(state)}")
    kinds: dict[str, dict[str, Any]] = {k: {} for k in ("modules", "optimizers", "loaders", "objects", "values")}
    for key, value in state.items():
        if not isinstance(key, str) or not key or "/" in key or key.startswith("$"):
            raise ConfigError(
                f"FabricSnapshots: the state's keys must be non-empty strings without '/' (not starting with '$'),"
                f" got {key!r}; rename that entry"
            )
        if isinstance(value, torch.nn.Module):
            kinds["modules"][key] = value
        elif isinstance(value, torch.optim.Optimizer):
            kinds["optimizers"][key] = value
        elif _is_loader(value):
            kinds["loaders"][key] = value
        elif callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
            kinds["objects"][key] = value
        else:
            kinds["values"][key] = value
    return kinds


def module_prefixes(keys: list[str]) -> dict[str, str]:
    """Where each module's weights are in the snapshot's ``state_dict``: as they are (one module), or after
    ``<key>.`` (several)."""
    if len(keys) == 1:
        return {keys[0]: ""}
    for a in keys:
        for b in keys:
            if a != b and b.startswith(f"{a}."):
                raise ConfigError(f"FabricSnapshots: the state's modules {a!r} and {b!r} overlap; rename one of them")
    return {k: f"{k}." for k in keys}


def _sharded_optimizer_targets(kinds: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The live optimizer state of the optimizers that train DTensors (FSDP2, tensor parallelism), by the names the
    snapshot gives it: each rank reads only its shards into them (a snapshot of another layout or world size is
    resharded). An optimizer without state yet (made for this run) gets it first, as torch's distributed checkpoint
    makes it (``get_optimizer_state_dict``)."""
    targets: dict[str, Any] = {}
    for index, opt in enumerate(kinds["optimizers"].values()):
        raw = raw_optimizer(opt)
        params = [p for group in raw.param_groups for p in group["params"]]
        if not any(is_dtensor(p) for p in params):
            continue
        if not raw.state:
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            owned = {id(p) for p in params}
            for module in kinds["modules"].values():
                inner = getattr(module, "module", module)  # (Fabric's wrapper: the module the parameters are of)
                if any(id(p) in owned for p in inner.parameters()):
                    get_optimizer_state_dict(inner, raw)
                    break
        _, tensors = encode({"optimizer_states": {str(index): raw.state_dict()}})
        targets.update({name: t for name, t in tensors.items() if is_dtensor(t)})
    return targets


def shared_tree(kinds: dict[str, dict[str, Any]], step: int) -> dict[str, Any]:
    """What every rank holds alike (weights and optimizer state: staged in the background, each rank its share, DTensor
    shards as they are), laid out as the capture plan takes it (:class:`~lightning_snapshot.staging.live.LiveCapture`):
    :func:`shared_head`, then the weights and the optimizers' states."""
    prefixes = module_prefixes(list(kinds["modules"]))
    return {
        **shared_head(kinds, step),
        "state_dict": {
            name: t for k, m in kinds["modules"].items() for name, t in m.state_dict(prefix=prefixes[k]).items()
        },
        "optimizer_states": [raw_optimizer(o).state_dict() for o in kinds["optimizers"].values()],
    }


def shared_head(kinds: dict[str, dict[str, Any]], step: int) -> dict[str, Any]:
    """The plain values before the tensors of :func:`shared_tree`: the step, and where each module's weights and each
    optimizer's state are (one module's weights as a Lightning checkpoint's ``state_dict``, so that
    ``lightning-snapshot export`` and ``load_snapshot(keys=["state_dict"])`` find them; several: each name prefixed by
    its key; ``optimizer_states`` in the order of ``fabric/optimizers``)."""
    return {
        "global_step": step,
        "fabric": {"modules": module_prefixes(list(kinds["modules"])), "optimizers": list(kinds["optimizers"])},
    }


class FabricSource:
    """The user's ``state`` as the snapshot pipeline takes it (:class:`~lightning_snapshot.fit.source.StateSource`).

    Args:
        state: the user's dict (followed as it is: entries added or replaced are snapshotted from the next step).
        strategy: the Fabric strategy (the capture plan stands in for the ``state_dict()`` calls under one device and
            DDP; the replica check compares DDP's replicas).
    """

    def __init__(self, state: MutableMapping[str, Any], strategy: Any) -> None:
        self.state = state
        self.strategy = strategy
        #: the optimizer steps taken (counted on from a restored snapshot's)
        self.global_step = 0
        self._joined: tuple[tuple[int, ...], torch.nn.Module] | None = None

    def step(self) -> int:
        return self.global_step

    def epoch(self) -> int:
        epoch = self.state.get("epoch", 0)
        return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else 0

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [raw_optimizer(o) for o in split(self.state)["optimizers"].values()]

    def capture_shared(self, live: LiveCapture) -> tuple[Any, tuple[dict[str, Any], list[torch.Tensor]]]:
        kinds = split(self.state)
        module = self._module(kinds)
        if module is None:
            live.clear()
            return shared_tree(kinds, self.global_step), ({}, [])
        optimizers = [raw_optimizer(o) for o in kinds["optimizers"].values()]
        head = shared_head(kinds, self.global_step)
        full = functools.partial(shared_tree, kinds, self.global_step)
        return live.capture(head, module, optimizers, full), ({}, [])

    def capture_rank(self, token: object | None, consumed_offset: int, validation_pending: bool) -> dict[str, Any]:
        return rank_tree(split(self.state), self.global_step)

    def replicated(self) -> tuple[Any, set[str]] | None:
        from lightning.fabric.strategies import DDPStrategy

        if not isinstance(self.strategy, DDPStrategy):
            return None
        kinds = split(self.state)
        module = self._module(kinds)
        if module is None:
            return None
        prefixes = module_prefixes(list(kinds["modules"]))
        ignored: set[str] = set()
        for key, wrapped in kinds["modules"].items():
            names = getattr(getattr(wrapped, "_forward_module", None), "parameters_to_ignore", None) or ()
            ignored.update(f"{prefixes[key]}{name}" for name in names)
        return module, ignored

    def _module(self, kinds: dict[str, dict[str, Any]]) -> torch.nn.Module | None:
        """The one module whose ``state_dict()`` is the snapshot's ``state_dict`` (several: joined under their keys,
        as :func:`shared_tree` names them), or None where the capture plan may not stand in for the strategy's
        state dicts (a sharded one: DTensors, Fabric's FSDP)."""
        from lightning.fabric.strategies import DDPStrategy, SingleDeviceStrategy

        if type(self.strategy) not in (SingleDeviceStrategy, DDPStrategy) or not kinds["modules"]:
            return None
        inner = {k: getattr(m, "_original_module", m) for k, m in kinds["modules"].items()}
        if any(is_dtensor(p) for m in inner.values() for p in m.parameters()):
            return None
        if len(inner) == 1:
            return next(iter(inner.values()))
        ids = tuple(id(m) for m in inner.values())
        if self._joined is None or self._joined[0] != ids:
            self._joined = (ids, torch.nn.ModuleDict(inner))
        return self._joined[1]


def rank_tree(kinds: dict[str, dict[str, Any]], step: int) -> dict[str, Any]:
    """This rank's own state: its RNG, its loaders' positions, the objects' state and the plain values."""
    loaders: dict[str, Any] = {}
    for key, loader in kinds["loaders"].items():
        inner = inner_loader(loader)
        calls = getattr(loader, "_num_iter_calls", None)
        entry: dict[str, Any] = {"iter_calls": calls if isinstance(calls, int) else None}
        epoch = max(0, (calls or 1) - 1) if isinstance(calls, int) else 0
        if _data.is_stateful(inner):
            entry["stateful"] = inner.state_dict()
            entry["current"] = True
            # (the RNG its stateless sampler drew the epoch's order from: under DDP Fabric wraps torchdata's
            # RandomSampler in a DistributedSamplerWrapper, whose order the loader's own state does not hold)
            entry["position"] = _data.position(inner, epoch, 0)
        else:
            position = _data.position(inner, epoch, _data.own_batches(inner, 0))
            entry["position"] = position
            entry["current"] = position is not None
        loaders[key] = entry
    return {
        "global_step": step,
        "rng": capture_rng(),
        "loaders": loaders,
        "objects": {k: o.state_dict() for k, o in kinds["objects"].items()},
        "values": dict(kinds["values"]),
    }


def read_targets(kinds: dict[str, dict[str, Any]], tree: Any, where: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The live tensors a snapshot's shared state is read into, by entry name (the modules' CPU and DTensor tensors,
    the optimizer state of sharded parameters), and where each module's weights are in it.

    Raises:
        StateMismatchError: the snapshot was not taken by FabricSnapshots, or holds none of a module of ``state``.
    """
    own = tree.get("fabric") if isinstance(tree, dict) else None
    saved = own.get("modules") if isinstance(own, dict) else None
    if not isinstance(saved, dict):
        raise StateMismatchError(
            f"the {where} was not taken by FabricSnapshots (it holds no 'fabric' record): resume it with the"
            " callback it was taken with, or load it with lightning_snapshot.load_snapshot"
        )
    targets: dict[str, Any] = {}
    for key, module in kinds["modules"].items():
        prefix = saved.get(key)
        if not isinstance(prefix, str):
            raise StateMismatchError(
                f"the {where} holds no module {key!r} (it holds {sorted(saved)}): it was taken from another state;"
                " pass resume=False to start fresh"
            )
        for name, t in module.state_dict().items():
            if isinstance(t, torch.Tensor) and (is_dtensor(t) or (t.device.type == "cpu" and t.is_contiguous())):
                targets[f"state_dict/{prefix}{name}"] = t
    targets.update(_sharded_optimizer_targets(kinds))
    return targets, cast("dict[str, str]", saved)


def split_modules(
    kinds: dict[str, dict[str, Any]], shared: Any, prefixes: dict[str, str], where: str
) -> dict[str, dict[str, Any]]:
    """Each module's weights out of the shared state as read, checked against the module (names and shapes).

    Raises:
        SnapshotError: no weights; StateMismatchError: another model's (naming the keys).
    """
    if not isinstance(shared, dict) or not isinstance(shared.get("state_dict"), dict):
        raise SnapshotError(f"the {where} holds no training state")
    flat = shared["state_dict"]
    modules: dict[str, dict[str, Any]] = {}
    for key, module in kinds["modules"].items():
        prefix = prefixes[key]
        sd = {name[len(prefix) :]: v for name, v in flat.items() if name.startswith(prefix)}
        check_model(module, sd, f"the {where} (module {key!r})")
        modules[key] = sd
    return modules


def apply(
    state: MutableMapping[str, Any],
    modules: dict[str, dict[str, Any]],
    shared: dict[str, Any],
    rank: dict[str, Any],
    exact: bool,
    where: str,
) -> None:
    """Put a snapshot read on every rank into ``state``, in place: the modules' weights (``modules``:
    :func:`split_modules`), the optimizers, the objects, the values, the loaders' positions and (``exact``: the same
    world size) this rank's RNG, last."""
    kinds = split(state)
    for key, module in kinds["modules"].items():
        module.load_state_dict(modules[key])
    own = shared.get("fabric")
    keys = own.get("optimizers") if isinstance(own, dict) else None
    states = shared.get("optimizer_states")
    if not isinstance(keys, list) or not isinstance(states, list) or len(keys) != len(states):
        raise SnapshotError(f"the {where} does not say which optimizer each saved optimizer state is of")
    saved_opts = dict(zip(keys, states, strict=True))
    for key, opt in kinds["optimizers"].items():
        if key not in saved_opts:
            raise StateMismatchError(f"the {where} holds no optimizer {key!r} (it holds {sorted(saved_opts)})")
        try:
            raw_optimizer(opt).load_state_dict(saved_opts[key])
        except (ValueError, KeyError) as e:
            raise StateMismatchError(f"the {where} holds another optimizer as {key!r}: {e}") from e
    objects = rank.get("objects") or {}
    for key, obj in kinds["objects"].items():
        if key in objects:
            obj.load_state_dict(objects[key])
    for key, value in (rank.get("values") or {}).items():
        state[key] = value
    loaders = rank.get("loaders") or {}
    for key, loader in kinds["loaders"].items():
        if key in loaders:
            _resume_loader(loader, loaders[key], exact)
    if exact and isinstance(rank.get("rng"), dict):
        restore_rng(rank["rng"])  # (last: nothing above may draw from it)


def _resume_loader(loader: Any, saved: dict[str, Any], exact: bool) -> None:
    inner = inner_loader(loader)
    calls = saved.get("iter_calls")
    position = saved.get("position")
    if saved.get("stateful") is not None and _data.is_stateful(inner):
        inner.load_state_dict(saved["stateful"])
        _iterate_once_without_drawing(inner)
        workers = int(getattr(inner, "num_workers", 0) or 0)
        if workers and _mid_epoch(saved["stateful"], inner):  # (the workers' RNG has moved on since the epoch began)
            warnings.warn(
                f"lightning-snapshot: the loader ({type(inner).__name__}) restores its own position, and its {workers}"
                " worker processes restart their global RNG (torch, numpy, random) from their seeds: random"
                " augmentation drawn there is not resumed exactly. Keep the augmentation's RNG in the dataset's"
                " state_dict(), or use a torch DataLoader (lightning-snapshot restores its workers' RNG)",
                stacklevel=3,
            )
        recorder = getattr(getattr(inner, "batch_sampler", None), "sampler", None)
        if exact and isinstance(recorder, _data.DrawRecorder) and isinstance(position, dict):
            recorder.replay = position.get("draw_rng")  # (the interrupted epoch's order is drawn again)
    if position is not None and not _data.is_stateful(inner):
        sampler = _data.install(inner)
        if sampler is not None:
            _data.plan_resume(sampler, inner, position, exact, int(position["epoch"]))
    if isinstance(calls, int) and hasattr(loader, "_num_iter_calls"):
        # (Fabric's loader sets its sampler's epoch from how often it was iterated: the resumed epoch's again)
        loader._num_iter_calls = calls - 1 if saved.get("current") else calls


def _mid_epoch(state: Any, loader: Any) -> bool:
    """Whether a ``StatefulDataLoader`` state (torchdata 0.11: with workers, under ``_snapshot``) is inside its epoch:
    past its first batch and before its last."""
    if not isinstance(state, dict) or state.get("_iterator_finished"):
        return False
    snapshot = state.get("_snapshot")
    main = snapshot.get("_main_snapshot") if isinstance(snapshot, dict) else state
    yielded = int(main.get("_sampler_iter_yielded") or 0) if isinstance(main, dict) else 0
    try:
        length = len(loader)
    except TypeError:  # (an iterable dataset without a length)
        return yielded > 0
    return 0 < yielded < length


def _iterate_once_without_drawing(loader: Any) -> None:
    """The next iterator of a resumed stateful loader continues the interrupted one, whose state (base seed, sampler)
    it loads: it is created with the global torch RNG put back after it (making an iterator draws a base seed from
    it, which the interrupted run drew at its epoch's start, not at this point)."""
    made = getattr(loader, "_get_iterator", None)
    if not callable(made) or "_get_iterator" in vars(loader):
        return

    def get_iterator() -> Any:
        vars(loader).pop("_get_iterator", None)  # (once)
        with torch.random.fork_rng(devices=[]):
            return made()

    loader._get_iterator = get_iterator
