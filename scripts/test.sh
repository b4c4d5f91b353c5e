#!/usr/bin/env bash
# Run the whole test suite (slow tests included) in the project's own virtual environment, on two pytest-xdist
# workers (LS_TEST_WORKERS=N for another number, 0 for none); the files whose tests share module fixtures are each kept on one worker (xdist_group).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"` or `bash scripts/test.sh -k resume`.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
WORKERS="${LS_TEST_WORKERS:-2}"
PARALLEL=()
if [ "$WORKERS" != "0" ]; then PARALLEL=(-n "$WORKERS" --dist loadgroup); fi
exec python -m pytest -q -p no:cacheprovider --durations=25 "${PARALLEL[@]}" "$@"
