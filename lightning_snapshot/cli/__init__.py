"""The ``lightning-snapshot`` command: the parser and exit statuses (main), each sub-command (commands), and
the operations behind them: export, copy and garbage collection (export, ops), and the goodput planner (plan).

May import: everything below the integrations (restore, persist, backends, format, schedule, dist, errors) and the
agent (``lightning-snapshot agent``).
"""

from lightning_snapshot.cli.main import main

__all__ = ["main"]
