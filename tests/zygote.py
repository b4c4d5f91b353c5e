"""A pre-imported parent that starts the test scripts by ``fork`` (conftest.run_script), instead of a fresh
interpreter that imports torch and Lightning again for each run (seconds per process, hundreds of processes).

One server per pytest process (per xdist worker), started at its first use: ``python tests/zygote.py``, which
imports torch, Lightning, lightning-snapshot and the scripts' shared modules, then serves requests read from its
stdin, one JSON line each (script, arguments, environment, working directory, output files). For each it forks a
child that is what ``python SCRIPT ARGS`` would be: a new session, that environment, ``sys.argv`` and
``sys.path[0]`` as the interpreter sets them, stdin from /dev/null, stdout and stderr into the files; the script runs
as ``__main__``. The server answers the child's pid, then its exit status once it ends (``-N`` for signal N, as
``subprocess`` reports it), one JSON line each. A child killed with SIGKILL (the crash tests) is reported as -9.

A run whose environment differs from the server's in a variable that may be read while torch or Lightning is
imported (anything but the allowlisted prefixes below: ``PYTHONPATH``, ``TORCH_*``, ``OMP_*``...) is run in a fresh
interpreter instead, as before: what it changes would not reach modules the server imported already. So is every
run when ``LS_TEST_ZYGOTE=0``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

#: Environment variables a test may set or change and still be run by the server: read only while a script runs
#: (the tests' fixtures set XDG_STATE_HOME for every test; botocore reads AWS_* when a client is made; torch and
#: Lightning set PYTORCH_NVML_BASED_CUDA_CHECK and TORCHINDUCTOR_CACHE_DIR in the test process once a test has run
#: Lightning in it, as they did in the server when it imported them, and seed_everything sets PL_GLOBAL_SEED and
#: PL_SEED_WORKERS, read when seeding)
ALLOWED_PREFIXES = (
    "LIGHTNING_SNAPSHOT_",
    "LS_TEST_",
    "SETUPS_",
    "RESHARD_",
    "PYTEST_",
    "PYTHONWARNINGS",
    "XDG_STATE_HOME",
    "NODE_RANK",
    "AWS_",
    "CUBLAS_WORKSPACE_CONFIG",
    "PYTORCH_NVML_BASED_CUDA_CHECK",
    "TORCHINDUCTOR_",
    "PL_GLOBAL_SEED",
    "PL_SEED_WORKERS",
)
DISABLE_ENV = "LS_TEST_ZYGOTE"


# ------------------------------------------------------------------------------------------------------ the server
def _child(request: dict[str, Any]) -> None:
    """In the forked child: become ``python SCRIPT ARGS`` and run it; never returns."""
    code = 1
    try:
        os.setsid()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
        os.close(null)
        script = request["script"]
        sys.argv = [script, *request["args"]]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        import runpy

        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - printed as the interpreter would
            traceback.print_exc()
            code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - nothing left to report it to
                pass
        os._exit(code)


def serve() -> None:
    """The server's loop: one request per line of stdin, until it closes."""
    import warnings

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    # what the scripts import (each stays imported in the children)
    import lightning.pytorch  # noqa: F401
    import numpy  # noqa: F401
    import torch  # noqa: F401

    import lightning_snapshot
    import lightning_snapshot.backends
    import lightning_snapshot.callback  # noqa: F401

    try:
        import torchmetrics  # noqa: F401
    except ImportError:
        pass
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(json.dumps({"rc": rc}), flush=True)


# ------------------------------------------------------------------------------------------------------ the client
class Zygote:
    """The test process's handle on its server (started lazily, stopped when the test process exits)."""

    def __init__(self, env: dict[str, str]) -> None:
        """``env``: the environment the server runs in, and that a run must have to be forked from it (the test
        process's own at its start, before any test changed it: a server started inside a test that set
        ``PYTHONPATH`` would serve only runs with that ``PYTHONPATH``)."""
        self.env = dict(env)
        self.proc = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**self.env, "PYTHONWARNINGS": "ignore::DeprecationWarning"},
            start_new_session=True,
        )
        self.env["PYTHONWARNINGS"] = "ignore::DeprecationWarning"
        self._reply(600)  # ("ready", once its imports are done)

    def _reply(self, timeout: float) -> dict[str, Any] | None:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, timeout))
        if not ready:
            return None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the test scripts' fork server exited")
        return json.loads(line)

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a run with environment ``env`` may be forked from the server (see the module's documentation)."""
        if self.proc.poll() is not None:
            return False
        return not self.differs(env)

    def differs(self, env: dict[str, str]) -> list[str]:
        """The variables of ``env`` that keep a run from being forked (they differ from the server's, and may be read
        while torch or Lightning is imported)."""
        keys = set(env) | set(self.env)
        return sorted(k for k in keys if env.get(k) != self.env.get(k) and not k.startswith(ALLOWED_PREFIXES))

    def run(self, cmd: list[str], env: dict[str, str], timeout: float, tmp: Path) -> subprocess.CompletedProcess[str]:
        """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)``, forked."""
        out, err = tmp / "stdout", tmp / "stderr"
        request = {
            "script": cmd[1],
            "args": cmd[2:],
            "env": env,
            "cwd": os.getcwd(),
            "stdout": str(out),
            "stderr": str(err),
        }
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        started = self._reply(60)
        if started is None:
            raise RuntimeError("the test scripts' fork server did not start the script")
        pid = started["pid"]
        done = self._reply(timeout)
        if done is None:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._reply(30)
            raise subprocess.TimeoutExpired(cmd, timeout, output=_read(out), stderr=_read(err))
        return subprocess.CompletedProcess(cmd, done["rc"], _read(out), _read(err))

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


if __name__ == "__main__":
    serve()
