#!/usr/bin/env bash
# Run the whole test suite (slow tests included) in the project's own virtual environment.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"` or `bash scripts/test.sh -k resume`.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
exec python -m pytest -q -p no:cacheprovider --durations=25 "$@"
