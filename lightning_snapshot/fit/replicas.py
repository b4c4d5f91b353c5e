"""The replica check: under data parallelism, every rank should hold the same parameters and optimizer state; a
snapshot compares a checksum of them across the ranks, and says which tensors and ranks disagree.

Why: DDP keeps the replicas equal only for the parameters it registered when it wrapped the model. A parameter that
did not require a gradient then and is unfrozen later (``BackboneFinetuning``) is trained by each rank from its own
gradients, so the replicas drift apart with no error; silent data corruption on one GPU does the same. A snapshot
holds each rank's share of the replicated state, so such a snapshot mixes the replicas.

Called by the snapshot pipeline (pipeline.py) at the point a snapshot is finished, on every rank together, right
before it is handed to the persist threads: the state checked is the state the snapshot holds. What is checked:

- every parameter of the LightningModule (buffers are not: DDP broadcasts them from rank 0 at each forward, so
  between two forwards they differ by design; nor the parameters DDP is told to ignore) and every tensor of every
  optimizer's state;
- a rotating slice of them by bytes, so that each snapshot costs about ``1/slices`` of a full check and all of
  them are checked every ``slices`` snapshots; besides, at each of the next ``max(2, slices)`` checks, the
  parameters an optimizer began to train since the last check (an unfreeze) and their optimizer state, so the first
  check after they trained a step compares them; and, until they agree again, the tensors that disagreed.

The checksum of a tensor is the wrapping sum of its bytes read as 64-bit integers, taken on the tensor's device with
no copy (a native reduction at memory speed; small tensors in batches): any change of one value (one ulp) changes
it; two changes that cancel out do not. The ranks exchange the checksums (8 bytes per tensor checked) in one
collective; the value most ranks hold is the reference and the others are named. The pipeline acts on the verdict as
``on_replica_mismatch`` says.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ReplicaChecker", "Verdict", "checksums", "named_tensors", "replicated_tensors", "verdict"]

#: The most disagreeing tensors a verdict names (a manifest records at most these, and the count).
MAX_NAMED = 16

_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """One tensor's checksum (an int64 tensor on its device): the wrapping sum of its bytes read as 64-bit words
    (a native reduction at memory speed), the few bytes past the last whole word read as integers of the dtype's
    width. A different value of one element changes one word, so the sum."""
    t = t.detach()
    flat = (torch.view_as_real(t) if t.is_complex() else t).reshape(-1)  # (a copy only if it is not contiguous)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    if flat.data_ptr() % 8:
        flat = flat.clone()  # (a view at an odd offset: aligned, so that the result does not depend on where it is)
    width = flat.element_size()
    ints = flat.view(_INT_OF_WIDTH[width])
    whole = flat.numel() * width // 8 * 8 // width  # elements in whole 64-bit words
    head = ints[:whole].view(torch.int64).sum()
    return head + ints[whole:].sum(dtype=torch.int64) if whole < ints.numel() else head


#: Tensors up to this size are checksummed in batches (one pass over each group of one device and dtype), so that a
#: model of many small tensors does not pay a few torch calls per tensor. On a GPU, where each call costs a kernel
#: launch or more (about 50 us per tensor for GPT-2 medium's 1168), tensors whose running sum fits in
#: :data:`BATCH_BYTES` are (4M elements: 16 MiB of float32).
SMALL_BYTES = 64 << 10

#: The most bytes of 64-bit running sum one batch makes (8 per element, whatever the dtype): its transient memory is
#: at most about three times this (the flattened copy, its values as 64-bit integers, and their running sum).
BATCH_BYTES = 32 << 20


_COMPLEX = {torch.complex32, torch.complex64, torch.complex128}


def _batched(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The checksums of tensors of one device and dtype (an int64 tensor): each the wrapping sum of its values read
    as integers of their width, from one flattened copy of them all (segment sums of a running sum)."""
    flat = _flatten(tensors)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    running = flat.view(_INT_OF_WIDTH[flat.element_size()]).cumsum(0, dtype=torch.int64)
    ends = torch.tensor(list(map(_NUMEL, tensors)), dtype=torch.int64).cumsum(0).to(running.device, non_blocking=True)
    if not running.numel():
        return torch.zeros(len(tensors), dtype=torch.int64, device=running.device)
    upto = running[(ends - 1).clamp_(min=0)].masked_fill_(ends == 0, 0)  # the running sum at each tensor's end
    return upto - torch.cat([upto.new_zeros(1), upto[:-1]])


_NUMEL = torch.Tensor.numel


def _flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    try:  # (one C++ call for the whole list: flatten and concatenate)
        return torch._utils._flatten_dense_tensors(tensors)
    except (AttributeError, RuntimeError, TypeError):  # pragma: no cover - torch without it
        return torch.cat([t.reshape(-1) for t in tensors])


def checksums(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The checksum of each tensor, computed on its device (one transfer to the host per device): a tensor of more
    than :data:`SMALL_BYTES` (on a CPU) or of more elements than :data:`BATCH_BYTES` / 8 (on another device) by
    :func:`_checksum`, smaller ones by :func:`_batched`, in batches whose 64-bit running sum fits in
    :data:`BATCH_BYTES`. Either way a different value of one element changes it, and it depends only on the tensor's
    device type, dtype and values (the same on every rank)."""
    out: list[Any] = [None] * len(tensors)
    groups: dict[tuple[torch.device, torch.dtype], list[list[Any]]] = {}  # batches of [indices, tensors, sum bytes]
    with torch.no_grad():  # (no autograd bookkeeping, and no detach per tensor)
        for i, t in enumerate(tensors):
            if t.dtype in _COMPLEX:
                t = torch.view_as_real(t)
            numel = t.numel()
            running = numel * 8  # (bytes of its part of a batch's running sum, in 64-bit integers)
            if (numel * t.element_size() > SMALL_BYTES) if t.device.type == "cpu" else (running > BATCH_BYTES):
                out[i] = _checksum(t).reshape(1)
                continue
            batches = groups.setdefault((t.device, t.dtype), [])
            if not batches or batches[-1][2] + running > BATCH_BYTES:
                batches.append([[], [], 0])
            batch = batches[-1]
            batch[0].append(i)
            batch[1].append(t)
            batch[2] += running
        parts: dict[torch.device, list[tuple[list[int], torch.Tensor]]] = {}
        for (device, _), batches in groups.items():
            for idx, members, _ in batches:
                parts.setdefault(device, []).append((idx, _batched(members)))
        for i, s in enumerate(out):
            if s is not None:
                parts.setdefault(s.device, []).append(([i], s))
        result = [0] * len(tensors)
        for chunks in parts.values():
            values = torch.cat([v for _, v in chunks]).tolist()
            for i, v in zip((i for idx, _ in chunks for i in idx), values, strict=True):
                result[i] = int(v)
    return result


@dataclass(frozen=True)
class Mismatch:
    """One tensor whose replicas disagree: ``ranks`` hold another value than the reference (the value most ranks
    hold; with no majority, the lowest rank's)."""

    tensor: str
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Verdict:
    """The outcome of one check at ``step``: how many tensors were compared across ``world_size`` ranks, and which
    disagree."""

    step: int
    checked: int
    world_size: int
    disagree: tuple[Mismatch, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.disagree

    def record(self) -> dict[str, Any]:
        """The manifest's ``replicas`` field (plain JSON; the first :data:`MAX_NAMED` tensors that disagree)."""
        return {
            "checked": self.checked,
            "disagree_count": len(self.disagree),
            "disagree": [{"tensor": m.tensor, "ranks": list(m.ranks)} for m in self.disagree[:MAX_NAMED]],
        }

    def describe(self) -> str:
        """What the user reads: the step, the tensors and ranks that disagree, and what causes it."""
        named = ", ".join(
            f"{m.tensor!r} (rank{'s' if len(m.ranks) > 1 else ''} {_ranks(m.ranks)})" for m in self.disagree[:MAX_NAMED]
        )
        more = len(self.disagree) - MAX_NAMED
        return (
            f"lightning-snapshot: the replicas of the model disagree at step {self.step}: {len(self.disagree)} of"
            f" {self.checked} tensors checked across {self.world_size} ranks differ from the other ranks' copy:"
            f" {named}{f' and {more} more' if more > 0 else ''}. Under DDP every rank should hold the same parameters"
            " and optimizer state. Usual causes: a parameter that did not require a gradient when DDP wrapped the"
            " model and was unfrozen later (BackboneFinetuning, or requires_grad_(True) in a hook): DDP does not"
            " synchronize its gradients, so each rank trains its own copy (keep such a parameter requiring a"
            " gradient when DDP wraps the model, and freeze it through the optimizer instead: left out of it, or a"
            " learning rate of 0); or silent data corruption on the GPU of the named rank"
        )


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))


def verdict(step: int, names: Sequence[str], gathered: Sequence[Sequence[int]]) -> Verdict:
    """Compare every rank's checksums (``gathered[rank][i]`` of tensor ``names[i]``)."""
    world = len(gathered)
    bad: list[Mismatch] = []
    for i, name in enumerate(names):
        values = [g[i] for g in gathered]
        if len(set(values)) == 1:
            continue
        tally: dict[int, int] = {}
        for v in values:
            tally[v] = tally.get(v, 0) + 1
        top = max(tally.values())
        reference = next(v for v in values if tally[v] == top)  # (ties: the lowest rank's value)
        bad.append(Mismatch(name, tuple(r for r, v in enumerate(values) if v != reference)))
    return Verdict(step, len(names), world, tuple(bad))


@dataclass
class _Plan:
    """The tensors a check may compare (weak references: a tensor replaced since is not kept alive), their names,
    owners and slices, while ``key`` (the capture plan's token) is the same object."""

    refs: list[Any]
    names: list[str]
    owners: list[str]  # the parameter each tensor is or belongs to (its optimizer state)
    slices: list[int]  # the slice of each tensor
    param_ids: dict[int, str]  # id of each parameter -> its name
    key: Any


def replicated_tensors(
    pl_module: Any, optimizers: Sequence[Any], ignored: set[str]
) -> tuple[list[str], list[Any], list[str], dict[int, str]]:
    """The names and tensors a replica check compares: the module's parameters (but ``ignored``) and every tensor of
    every optimizer's state, in a stable order; the parameter each belongs to; each parameter's name by id."""
    names: list[str] = []
    tensors: list[Any] = []
    owners: list[str] = []
    param_names: dict[int, str] = {}
    for name, p in pl_module.named_parameters():
        param_names[id(p)] = name
        if name in ignored or p.layout is not torch.strided:
            continue
        names.append(name)
        tensors.append(p)
        owners.append(name)
    for i, opt in enumerate(optimizers):
        params = itertools.chain.from_iterable(g["params"] for g in opt.param_groups)
        for j, p in enumerate(params):
            state = opt.state.get(p)
            if not state:
                continue
            pname = param_names.get(id(p), f"param {j}")
            if pname in ignored:
                continue
            for key, v in state.items():
                if isinstance(v, torch.Tensor) and v.layout is torch.strided:
                    names.append(f"optimizer {i} {key} of {pname}")
                    tensors.append(v)
                    owners.append(pname)
    return names, tensors, owners, param_names


def named_tensors(tree: Any, wanted: Sequence[Any]) -> list[tuple[str, Any]]:
    """The tensors of ``wanted`` found in ``tree`` (nested dicts and lists: the tensor parts' state), each with its
    '/'-separated path, in the tree's order (each once)."""
    ids = {id(t) for t in wanted}
    out: list[tuple[str, Any]] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, torch.Tensor):
            if id(node) in ids:
                ids.discard(id(node))
                out.append((path, node))
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{path}/{k}" if path else str(k))
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}" if path else str(i))

    walk(tree, "")
    return out


class ReplicaChecker:
    """Which tensors each snapshot of a fit compares, and the comparison (see the module's docstring).

    Args:
        slices: the replicated state is checked over this many snapshots (each a rotating slice by bytes); 1: all of
            it at every snapshot.
    """

    def __init__(self, slices: int) -> None:
        self.slices = slices
        self.count = 0  # checks done (the same on every rank: every rank finishes the same snapshots)
        self._plan: _Plan | None = None
        self._trained: set[int] | None = None  # ids of the parameters the optimizers trained at the last check
        self._sticky: set[str] = set()  # tensors that disagreed at the last check
        #: parameters trained since a recent check (an unfreeze), with their optimizer state: compared at each of the
        #: next checks (name -> checks left), so that the first check after they trained a step compares them
        self._watch: dict[str, int] = {}

    def _planned(
        self, pl_module: Any, optimizers: Sequence[Any], ignored: set[str], key: Any, extra: Any = None
    ) -> tuple[_Plan, list]:
        plan = self._plan
        if plan is not None and key is not None and plan.key is key:
            tensors = [r() for r in plan.refs]  # (the capture plan held: the very same tensors)
            if all(t is not None for t in tensors):
                return plan, tensors
        names, tensors, owners, param_ids = replicated_tensors(pl_module, optimizers, ignored)
        for name, t in extra() if extra is not None else ():
            if t.layout is torch.strided:
                names.append(name)
                tensors.append(t)
                owners.append(name)
        sizes = [t.numel() * t.element_size() for t in tensors]
        total = max(1, sum(sizes))
        slices, before = [], 0
        for size in sizes:
            slices.append(min(self.slices - 1, before * self.slices // total))
            before += size
        plan = _Plan([weakref.ref(t) for t in tensors], names, owners, slices, param_ids, key)
        self._plan = None if key is None else plan
        return plan, tensors

    def select(
        self,
        pl_module: Any,
        optimizers: Sequence[Any],
        ignored: set[str],
        trained: Any,
        key: Any = None,
        extra: Any = None,
    ) -> tuple[list[str], list[Any]]:
        """The names and tensors this check compares. ``trained``: what the optimizers train now
        (:func:`~lightning_snapshot.state.capture.optimized_key`: parameter ids and their ``requires_grad``); ``key``:
        an object that is the same while the tensors are (the capture plan's token, which then vouches for
        ``extra``'s too), or None; ``extra()``: more replicated tensors to compare, as (name, tensor) (the tensor
        parts' stable tensors: an averaged model's parameters), called only when the tensors are listed anew."""
        plan, tensors = self._planned(pl_module, optimizers, ignored, key, extra)
        ids, requires_grad = trained
        now = set(itertools.compress(ids, requires_grad))
        if self._trained is not None:
            for pid in now - self._trained:  # newly trained: compared at the next checks, until one after a step
                name = plan.param_ids.get(pid)
                if name is not None:
                    self._watch[name] = max(2, self.slices)
        self._trained = now
        part = self.count % self.slices
        self.count += 1
        sticky, watch = self._sticky, self._watch
        picked = [
            i
            for i, (s, n, o) in enumerate(zip(plan.slices, plan.names, plan.owners, strict=True))
            if s == part or n in sticky or o in watch
        ]
        self._watch = {n: left - 1 for n, left in watch.items() if left > 1}
        return [plan.names[i] for i in picked], [tensors[i] for i in picked]

    def check(self, step: int, names: list[str], tensors: list[Any], all_gather: Any) -> Verdict:
        """Compare the checksums of ``tensors`` across the ranks (``all_gather``: a list of ints -> every rank's
        list, in rank order; collective)."""
        # (every rank selects the same tensors: when a slice holds none, no rank calls the collective)
        gathered = all_gather(checksums(tensors)) if tensors else []
        result = verdict(step, names, gathered)
        self._sticky = {m.tensor for m in result.disagree}
        return result
