#!/usr/bin/env bash
# Run the quickstart demo: train, SIGKILL mid-epoch, resume, and compare bitwise with an uninterrupted run.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
exec python examples/quickstart.py "$@"
