"""conftest.run_script forks the test scripts from a pre-imported server (tests/zygote.py): a forked run must look
like ``python SCRIPT ARGS`` to the script (arguments, environment, ``__main__``, ``sys.path[0]``, exit status,
SIGKILL, stdout and stderr), and a run whose environment changes what imports read must get a fresh interpreter.
Each test starts from the test process's environment as it was before any test (``base_env``): what earlier tests of
the same worker left in it does not decide these tests."""

from __future__ import annotations

import json
import os

import pytest
from conftest import BASE_ENV, SCRIPTS, _zygote, run_script
from zygote import ALLOWED_PREFIXES


@pytest.fixture(autouse=True)
def base_env(monkeypatch):
    """The test process's environment from before any test changed it, but for what the server allows to differ
    (the session's XDG_STATE_HOME...); restored after the test."""
    for key in set(os.environ) - set(BASE_ENV):
        if not key.startswith(ALLOWED_PREFIXES):
            monkeypatch.delenv(key)
    for key, value in BASE_ENV.items():
        if os.environ.get(key) != value and not key.startswith(ALLOWED_PREFIXES):
            monkeypatch.setenv(key, value)


def probe(*args: str, expect_rc: int = 0, expect_kill: bool = False) -> tuple[dict, str]:
    proc = run_script("probe.py", *args, expect_rc=expect_rc, expect_kill=expect_kill)
    seen = json.loads(proc.stdout.splitlines()[0])
    server = _zygote()
    seen["differs"] = server.differs({**os.environ, "PYTHONWARNINGS": "ignore::DeprecationWarning"}) if server else None
    return seen, proc.stderr


def test_a_run_is_forked_with_its_arguments_environment_and_exit_status(monkeypatch):
    monkeypatch.setenv("LS_TEST_PROBE", "seen")
    seen, err = probe("a", "b c", "--exit", "3", "--stderr", "to stderr", expect_rc=3)
    assert seen.pop("differs") == [], seen
    assert seen == {
        "preloaded": True,
        "args": ["a", "b c"],
        "cwd": os.getcwd(),
        "main": "__main__",
        "probe": "seen",
        "path0": str(SCRIPTS),
    }
    assert err.strip() == "to stderr"


def test_a_forked_run_that_kills_itself_reports_sigkill():
    seen, _ = probe("--kill", expect_kill=True)
    assert seen["preloaded"], seen["differs"]


def test_a_run_that_changes_what_imports_read_gets_a_fresh_interpreter(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")]))
    seen, _ = probe("x")
    assert seen["preloaded"] is False and seen["args"] == ["x"]


def test_a_run_after_lightning_was_imported_in_the_test_process_is_still_forked(monkeypatch):
    """Importing Lightning sets PYTORCH_NVML_BASED_CUDA_CHECK in the importing process (torch's inductor sets
    TORCHINDUCTOR_CACHE_DIR when it runs): once a test ran Lightning in the test process, its environment differs from
    the server's start-up copy in those only, and runs must still be forked (else every later run of the suite pays
    a fresh interpreter)."""
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # (what `import lightning` does)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_test")
    seen, _ = probe("y")
    assert seen["preloaded"] is True and seen["args"] == ["y"], seen["differs"]


def test_a_run_after_seed_everything_in_the_test_process_is_still_forked():
    """``seed_everything`` in a test sets PL_GLOBAL_SEED and PL_SEED_WORKERS in the test process (read only when
    seeding): later runs are still forked."""
    import lightning as L

    L.seed_everything(3, workers=True, verbose=False)
    seen, _ = probe("z")
    assert seen["preloaded"] is True and seen["args"] == ["z"], seen["differs"]
