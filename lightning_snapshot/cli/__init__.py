"""The ``lightning-snapshot`` command: the parser, exit statuses and :func:`~lightning_snapshot.cli.main.main` (the
console script, ``lightning_snapshot.cli.main:main``) in :mod:`~lightning_snapshot.cli.main`, the sub-commands in
:mod:`~lightning_snapshot.cli.commands`, and the operations behind them: export, copy and garbage collection
(:mod:`~lightning_snapshot.cli.export`, :mod:`~lightning_snapshot.cli.ops`) and the goodput planner
(:mod:`~lightning_snapshot.cli.plan`).

May import: everything below the integrations (restore, persist, backends, format, schedule, dist, errors) and the
agent (``lightning-snapshot agent``). Nothing is imported here: ``python -m lightning_snapshot.cli.main`` runs the
command without importing it twice.
"""
