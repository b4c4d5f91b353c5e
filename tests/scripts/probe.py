"""What the process running a test script looks like (tests/test_zygote.py): prints one JSON line with whether torch
was imported before this script ran, its arguments, working directory and one environment variable; then exits
with ``--exit N``, or SIGKILLs itself with ``--kill``, writing ``--stderr TEXT`` to stderr first."""

import argparse
import json
import os
import signal
import sys

preloaded = "torch" in sys.modules
p = argparse.ArgumentParser()
p.add_argument("--exit", type=int, default=0)
p.add_argument("--kill", action="store_true")
p.add_argument("--stderr", default="")
p.add_argument("rest", nargs="*")
a = p.parse_args()
print(
    json.dumps(
        {
            "preloaded": preloaded,
            "args": a.rest,
            "cwd": os.getcwd(),
            "main": __name__,
            "probe": os.environ.get("LS_TEST_PROBE"),
            "path0": sys.path[0],
        }
    ),
    flush=True,
)
print(a.stderr, file=sys.stderr, flush=True)
if a.kill:
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(a.exit)
