"""cli."""

from lightning_snapshot.cli.main import main

__all__ = ["main"]
