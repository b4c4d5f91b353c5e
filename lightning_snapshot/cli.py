"""The ``lightning-snapshot`` command: list, inspect and verify snapshots in a tier.

    lightning-snapshot list /nvme/snap/run-42
    lightning-snapshot inspect /nvme/snap/run-42 [--step 1200]
    lightning-snapshot verify /nvme/snap/run-42 [--step 1200 | --all]
    lightning-snapshot export /nvme/snap/run-42 model.safetensors [--format safetensors|torch] [--step 1200]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from lightning_snapshot.errors import SnapshotError
from lightning_snapshot.loader import read_manifest, read_section, resolve_source
from lightning_snapshot.writer import committed_steps

__all__ = ["main"]


def _steps(source: str, step: int | None, every: bool = False) -> tuple[object, list[int]]:
    backend, named = resolve_source(source)
    if step is None:
        step = named
    steps = committed_steps(backend)
    if step is not None:
        if step not in steps:
            raise SnapshotError(f"no committed snapshot of step {step} in {backend.url!r} (committed: {steps})")
        return backend, [step]
    if not steps:
        raise SnapshotError(f"{backend.url!r} holds no committed snapshot")
    return backend, steps if every else steps[:1]


def _cmd_list(args: argparse.Namespace) -> int:
    backend, _ = resolve_source(args.source)
    steps = committed_steps(backend)
    if not steps:
        print(f"no committed snapshots in {backend.url}")
        return 0
    print(f"{'step':>12}  {'epoch':>5}  {'ranks':>5}  {'MiB':>10}  created")
    for step in steps:
        try:
            m = read_manifest(backend, step)
        except SnapshotError as e:
            print(f"{step:>12}  unreadable manifest: {e}")
            continue
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created_unix))
        print(f"{step:>12}  {m.epoch:>5}  {m.world_size:>5}  {m.total_bytes / 2**20:>10.2f}  {created}")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    backend, steps = _steps(args.source, args.step)
    m = read_manifest(backend, steps[0])
    print(f"step {m.step}, epoch {m.epoch}, world size {m.world_size}, format v{m.format_version},"
          f" written by lightning-snapshot {m.library_version}")
    print(f"{len(m.objects)} objects, {m.total_bytes} bytes; {len(m.tensors)} shared tensors")
    for t in m.tensors:
        target = f" -> alias of {t.alias_of}" if t.alias_of else ""
        print(f"  {t.name:<60} {t.dtype:<10} {list(t.global_shape)}{target}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    backend, steps = _steps(args.source, args.step, every=args.all)
    bad = 0
    for step in steps:
        t0 = time.monotonic()
        try:
            m = read_manifest(backend, step)
            read_section(backend, m, m.tensors, m.state)
            for section in m.ranks:
                read_section(backend, m, section.tensors, section.state)
        except SnapshotError as e:
            bad += 1
            print(f"step {step}: FAILED: {e}")
            continue
        print(f"step {step}: OK ({m.total_bytes} bytes verified in {time.monotonic() - t0:.2f} s)")
    return 1 if bad else 0


def _cmd_export(args: argparse.Namespace) -> int:
    from lightning_snapshot.export import export_snapshot

    out = export_snapshot(args.source, args.out, fmt=args.format, step=args.step, progress=not args.quiet)
    print(f"wrote {out} ({out.stat().st_size} bytes)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["agent"]:  # the snapshot agent has its own options (lightning-snapshot agent --help)
        from lightning_snapshot.agent import main as agent_main

        return agent_main(argv[1:])
    parser = argparse.ArgumentParser(prog="lightning-snapshot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("agent", help="run, stop or query a node's snapshot agent (see: lightning-snapshot agent --help)")
    p = sub.add_parser("list", help="committed snapshots of a tier")
    p.add_argument("source", help="tier path or URL")
    p.set_defaults(fn=_cmd_list)
    p = sub.add_parser("inspect", help="the manifest of one snapshot")
    p.add_argument("source", help="tier path/URL, or a step-* directory")
    p.add_argument("--step", type=int, default=None, help="step to inspect (default: newest)")
    p.set_defaults(fn=_cmd_inspect)
    p = sub.add_parser("verify", help="read back every chunk and check its checksum")
    p.add_argument("source", help="tier path/URL, or a step-* directory")
    p.add_argument("--step", type=int, default=None, help="step to verify (default: newest)")
    p.add_argument("--all", action="store_true", help="verify every committed snapshot")
    p.set_defaults(fn=_cmd_verify)
    p = sub.add_parser("export", help="one consolidated file: safetensors (weights) or torch (full state)")
    p.add_argument("source", help="tier path/URL, or a step-* directory")
    p.add_argument("out", help="file to write")
    p.add_argument("--format", choices=["safetensors", "torch"], default="safetensors",
                   help="safetensors: model weights; torch: the full training state for torch.load(weights_only=True)")
    p.add_argument("--step", type=int, default=None, help="step to export (default: newest)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(fn=_cmd_export)
    args = parser.parse_args(argv)
    try:
        return int(args.fn(args))
    except SnapshotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
