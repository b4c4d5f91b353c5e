"""The ``lightning-snapshot`` command: the parser and :func:`~lightning_snapshot.cli.main.main` (the console script,
``lightning_snapshot.cli.main:main``) in :mod:`~lightning_snapshot.cli.main`, the sub-commands in
:mod:`~lightning_snapshot.cli.commands`, their operations in :mod:`~lightning_snapshot.cli.ops`,
:mod:`~lightning_snapshot.cli.export` and :mod:`~lightning_snapshot.cli.plan`.

Nothing is imported here: ``python -m lightning_snapshot.cli.main`` runs the command without importing it twice.
"""
