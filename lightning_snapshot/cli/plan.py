"""``lightning-snapshot plan``: expected goodput, intervals and memory per tier set-up, from 1 to 16,384 nodes.

Called by the CLI's ``plan`` command (cli.py).

Three set-ups are compared: a local tier only; the RAM tier (one copy per node, ``erasure=None``) plus a local
tier; the RAM tier with erasure ``k+m`` plus a local tier and an object store. Per tier, the simulation
(:mod:`lightning_snapshot.schedule.simulate`) needs the training time one snapshot costs, how long until it is held,
and how
long a restore from it takes. They come from bandwidth figures, or from the metrics of a real run (its TensorBoard
event files: ``snapshot/<tier>/cost_ms`` of an ``every="auto"`` tier or else ``snapshot/stall_ms``,
``snapshot/<tier>/persist_ms``, ``snapshot/bytes``, ``restore/ms``), scaled to the state size asked for.

Model, stated: the job's MTBF is the per-node MTBF over the number of nodes; a failure loses a node with
probability ``--node-loss`` (its memory, so the copy-per-node RAM tier, but not the erasure-coded one, which
survives any single node); the local tier is readable after every failure (a shared filesystem, or node-local disks
that come back); the object store is kept for losses beyond that and costs training nothing more than its
background interference. A tier's interval is Young/Daly's for the failures its cheaper tiers do not cover (behind
the erasure-coded RAM tier, 1% of them), so the plan's intervals can be longer than ``every="auto"``'s, which plans
each tier for every failure. Host memory per node: the staging arena (two buffers of the node's state) plus what the
RAM tier keeps (``keep_last=2`` copies; with erasure ``(k+m)/k`` of each).

Beside the goodput, the restore time of a data-parallel (DDP) job from the object store, whose every GPU needs the
whole replicated state (``--state-bytes``), each way (:func:`restore_seconds`): every rank reading all of it (the path
before read-once restores: the job reads it ``nodes x GPUs`` times), and read once (each byte read by one rank, spread
over all of them, then sent to the others: between nodes over the network, within a node through memory).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_snapshot.errors import ConfigError, SnapshotNotFoundError
from lightning_snapshot.schedule.interval import DEFAULT_NODE_MTBF_S, parse_duration
from lightning_snapshot.schedule.simulate import Outcome, TierModel, simulate

__all__ = ["Figures", "add_arguments", "figures_from_events", "plan", "restore_seconds", "run"]

NODE_COUNTS = tuple(2**i for i in range(15))  # 1 .. 16,384
_RAM_KEEP = 2


@dataclass(frozen=True)
class Figures:
    """Per-node rates that make a tier's cost (bytes are the node's state: GPUs x state per GPU).

    Attributes:
        stall_gbps: GB/s per GPU at which a snapshot stalls training (device to host copy, hand-off).
        interference: fraction of a tier's background write time that training loses (copy threads, I/O).
        local_gbps, ram_gbps, net_gbps, object_gbps: write speed of the local tier, of the RAM tier (host memory),
            of the erasure shares over the network, of the object store (GB/s per node).
        local_read_gbps, ram_read_gbps: restore speeds (GB/s per node).
        store_gbps: the object store's aggregate read bandwidth, all nodes together (GB/s).
    """

    stall_gbps: float = 20.0
    interference: float = 0.05
    local_gbps: float = 2.0
    ram_gbps: float = 10.0
    net_gbps: float = 10.0
    object_gbps: float = 1.0
    local_read_gbps: float = 4.0
    ram_read_gbps: float = 10.0
    store_gbps: float = 200.0


def restore_seconds(nodes: int, gpus_per_node: int, state_bytes: float, figures: Figures, read_once: bool) -> float:
    """Seconds to restore a DDP job's replicated state (``state_bytes``, needed whole by every GPU) from the object
    store: the reads (each node at ``object_gbps``, all nodes together at most ``store_gbps``), plus, read once, the
    transfers to the ranks that did not read a part (between nodes at ``net_gbps``: each node receives what the other
    nodes read; within a node through memory at ``ram_read_gbps``).

    Per rank: the job reads ``nodes x gpus x state``, each node ``gpus x state``. Read once: the job reads the state
    once, each node ``state / nodes``.
    """
    gb = state_bytes / 1e9
    f = figures
    if not read_once:
        return max(gpus_per_node * gb / f.object_gbps, nodes * gpus_per_node * gb / f.store_gbps)
    read = max(gb / nodes / f.object_gbps, gb / f.store_gbps)
    between = gb * (nodes - 1) / nodes / f.net_gbps
    within = gb / f.ram_read_gbps if gpus_per_node > 1 else 0.0
    return read + between + within


def figures_from_events(logdir: str | os.PathLike[str]) -> Figures:
    """Bandwidth figures measured by a real run, from the TensorBoard event files under ``logdir``.

    Raises:
        SnapshotNotFoundError: no event file there, or none with ``snapshot/bytes``.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    paths = sorted({p.parent for p in Path(logdir).rglob("events.out.tfevents.*")})
    scalars: dict[str, list[float]] = {}
    for path in paths:
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            scalars.setdefault(tag, []).extend(e.value for e in acc.Scalars(tag))
    if not scalars.get("snapshot/bytes"):
        raise SnapshotNotFoundError(
            f"no TensorBoard events with snapshot metrics under {logdir!r}: pass the log"
            " directory of a run that used SnapshotCallback with a TensorBoardLogger"
        )

    def mean(tag: str) -> float | None:
        values = scalars.get(tag)
        return sum(values) / len(values) if values else None

    nbytes = mean("snapshot/bytes") or 1.0
    gb = nbytes / 1e9
    stall = mean("snapshot/stall_ms")
    kw: dict[str, float] = {}
    if stall:
        kw["stall_gbps"] = gb / (stall / 1000)
    persist = {tier: mean(f"snapshot/{tier}/persist_ms") for tier in ("local", "ram", "object")}
    for tier, field in (("local", "local_gbps"), ("ram", "ram_gbps"), ("object", "object_gbps")):
        ms = persist[tier]
        if ms:
            kw[field] = gb / (ms / 1000)
    costs = [(mean(f"snapshot/{t}/cost_ms"), persist[t]) for t in ("local", "ram", "object")]
    fractions = [max(0.0, c - (stall or 0.0)) / p for c, p in costs if c is not None and p]
    if fractions:
        kw["interference"] = sum(fractions) / len(fractions)
    restore = mean("restore/ms")
    if restore:
        kw["local_read_gbps"] = gb / (restore / 1000)
    return Figures(**kw)


def setups(figures: Figures, node_bytes: float, erasure: tuple[int, int], gpus: int = 1) -> dict[str, list[TierModel]]:
    """The three set-ups' tiers for one node of ``gpus`` GPUs holding ``node_bytes`` of state in all."""
    f, gb = figures, node_bytes / 1e9
    k, m = erasure
    stall = gb / gpus / f.stall_gbps  # every GPU copies its own state at once

    def tier(name: str, write_gbps: float, read_gbps: float, survives: bool) -> TierModel:
        persist = gb / write_gbps
        return TierModel(
            name,
            cost_s=stall + f.interference * persist,
            persist_s=persist,
            restore_s=gb / read_gbps,
            survives_node_loss=survives,
        )

    local = tier("local", f.local_gbps, f.local_read_gbps, True)
    ram = tier("ram", f.ram_gbps, f.ram_read_gbps, False)
    coded = gb * (k + m) / k
    ram_ec = TierModel(
        "ram-ec",
        cost_s=stall + f.interference * coded / f.net_gbps,
        persist_s=coded / f.net_gbps,
        restore_s=gb / f.net_gbps,
        survives_node_loss=True,
    )
    obj = tier("object", f.object_gbps, f.object_gbps, True)
    return {"local": [local], "ram+local": [ram, local], f"ram-ec{k}+{m}+local+object": [ram_ec, local, obj]}


def memory_bytes(setup: str, node_bytes: float, erasure: tuple[int, int]) -> float:
    """Host memory per node a set-up needs: the arena's two buffers, and what the RAM tier keeps."""
    k, m = erasure
    arena = 2 * node_bytes
    if setup.startswith("ram-ec"):
        return arena + _RAM_KEEP * node_bytes * (k + m) / k
    if setup.startswith("ram"):
        return arena + _RAM_KEEP * node_bytes
    return arena


def plan(
    *,
    nodes: list[int],
    gpus_per_node: int,
    node_mtbf_s: float,
    state_bytes: float,
    restart_s: float,
    work_s: float,
    figures: Figures,
    erasure: tuple[int, int] = (4, 2),
    node_loss: float = 0.5,
    seed: int = 0,
    runs: int = 4,
) -> list[dict[str, Any]]:
    """One row per node count and set-up: goodput, each tier's interval, memory per node."""
    rows = []
    node_bytes = gpus_per_node * state_bytes
    for n in nodes:
        mtbf = node_mtbf_s / n
        for name, tiers in setups(figures, node_bytes, erasure, gpus_per_node).items():
            usable = [t for t in tiers if not (t.name.startswith("ram-ec") and n < sum(erasure))]
            out: Outcome = simulate(
                usable, work_s=work_s, mtbf_s=mtbf, restart_s=restart_s, node_loss=node_loss, seed=seed, runs=runs
            )
            rows.append(
                {
                    "nodes": n,
                    "setup": name,
                    "mtbf_s": mtbf,
                    "goodput": out.goodput,
                    "failures": out.failures,
                    "intervals_s": {t.name: i for t, i in zip(usable, out.intervals_s, strict=True)},
                    "memory_bytes": memory_bytes(name, node_bytes, erasure),
                    "note": "" if len(usable) == len(tiers) else f"RAM erasure needs >= {sum(erasure)} nodes",
                }
            )
    return rows


def _bytes_arg(text: str) -> float:
    units = {
        "": 1,
        "k": 1e3,
        "m": 1e6,
        "g": 1e9,
        "t": 1e12,
        "kib": 1024,
        "mib": 1 << 20,
        "gib": 1 << 30,
        "tib": 1 << 40,
        "kb": 1e3,
        "mb": 1e6,
        "gb": 1e9,
        "tb": 1e12,
    }
    t = text.strip().lower()
    digits = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    try:
        value = float(digits) * units[t[len(digits) :]]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"expected bytes such as 2e9, 16GiB or 500MB, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of bytes, got {text!r}")
    return value


def _duration_arg(text: str) -> float:
    try:
        return parse_duration(text, "a duration")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _nodes_arg(text: str) -> list[int]:
    try:
        nodes = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected node counts such as 1,8,64, got {text!r}") from None
    if not nodes or any(n < 1 or n > 16384 for n in nodes):
        raise argparse.ArgumentTypeError(f"node counts must be 1 to 16384, got {text!r}")
    return nodes


def _erasure_arg(text: str) -> tuple[int, int]:
    k, _, m = text.partition("+")
    if not (k.isdigit() and m.isdigit()) or int(k) < 1 or int(m) < 1:
        raise argparse.ArgumentTypeError(f"expected k+m such as 4+2, got {text!r}")
    return int(k), int(m)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``plan`` subcommand's options."""
    p.add_argument(
        "--nodes",
        type=_nodes_arg,
        default=list(NODE_COUNTS),
        help="node counts, comma-separated (default: 1,2,4,...,16384)",
    )
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument(
        "--node-mtbf",
        type=_duration_arg,
        default=DEFAULT_NODE_MTBF_S,
        help="mean time between failures of one node (default 6000h)",
    )
    p.add_argument(
        "--state-bytes",
        type=_bytes_arg,
        default=16e9,
        help="snapshot bytes per GPU: weights, optimizer state, buffers (default 16GB)",
    )
    p.add_argument(
        "--restart",
        type=_duration_arg,
        default=300.0,
        help="from a failure until the job starts restoring (default 5m)",
    )
    p.add_argument(
        "--work", type=_duration_arg, default=30 * 86400.0, help="failure-free training time of the job (default 30d)"
    )
    p.add_argument("--erasure", type=_erasure_arg, default=(4, 2), help="the RAM tier's k+m (default 4+2)")
    p.add_argument(
        "--node-loss", type=float, default=0.5, help="probability that a failure loses its node's memory (default 0.5)"
    )
    p.add_argument(
        "--metrics",
        default=None,
        help="a real run's TensorBoard log directory: its measured speeds replace the figures below",
    )
    defaults = Figures()
    for field in (
        "stall_gbps",
        "interference",
        "local_gbps",
        "ram_gbps",
        "net_gbps",
        "object_gbps",
        "local_read_gbps",
        "ram_read_gbps",
        "store_gbps",
    ):
        p.add_argument(
            f"--{field.replace('_', '-')}",
            type=float,
            default=getattr(defaults, field),
            help=f"default {getattr(defaults, field)}",
        )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", type=int, default=4, help="simulated jobs averaged per row")


def _human(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.1f}s"


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run the ``plan`` subcommand: print the table; returns its rows."""
    if not 0 <= args.node_loss <= 1:
        raise ConfigError(f"--node-loss must be a probability from 0 to 1, got {args.node_loss}")
    if args.gpus_per_node < 1 or args.runs < 1:
        raise ConfigError("--gpus-per-node and --runs must be >= 1")
    if args.metrics is not None:
        figures = figures_from_events(args.metrics)
    else:
        figures = Figures(**{f: getattr(args, f) for f in Figures.__dataclass_fields__})
    if any(not (v > 0) for k, v in vars(figures).items() if k != "interference") or figures.interference < 0:
        raise ConfigError(f"bandwidths must be positive and interference >= 0, got {figures}")
    rows = plan(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        node_mtbf_s=args.node_mtbf,
        state_bytes=args.state_bytes,
        restart_s=args.restart,
        work_s=args.work,
        figures=figures,
        erasure=args.erasure,
        node_loss=args.node_loss,
        seed=args.seed,
        runs=args.runs,
    )
    print(
        f"{'nodes':>6} {'job MTBF':>9} {'set-up':<26} {'goodput':>8} {'failures':>9}  {'memory/node':>12}"
        f"  {'DDP restore from object store':>29}  intervals"
    )
    print(f"{'':>6} {'':>9} {'':<26} {'':>8} {'':>9}  {'':>12}  {'every rank':>14} {'read once':>14}")
    for r in rows:
        r["restore_s"] = {
            way: restore_seconds(r["nodes"], args.gpus_per_node, args.state_bytes, figures, way == "read_once")
            for way in ("per_rank", "read_once")
        }
        intervals = ", ".join(f"{k} {_human(v)}" for k, v in r["intervals_s"].items())
        print(
            f"{r['nodes']:>6} {_human(r['mtbf_s']):>9} {r['setup']:<26} {r['goodput']:>8.4f} {r['failures']:>9.1f}"
            f"  {r['memory_bytes'] / 1e9:>9.1f} GB  {_human(r['restore_s']['per_rank']):>14}"
            f" {_human(r['restore_s']['read_once']):>14}  {intervals}{'  (' + r['note'] + ')' if r['note'] else ''}"
        )
    return rows
