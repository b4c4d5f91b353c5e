# Sourced by the other scripts: create .venv (once) and install the project with its test and docs extras, torch
# pinned.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LS_VENV:-$ROOT/.venv}"
STAMP="$VENV/.installed-$(cat "$ROOT/pyproject.toml" "$ROOT/constraints.txt" | cksum | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtual environment $VENV" >&2
  python3 -m venv "$VENV"
fi
if [ ! -f "$STAMP" ]; then
  echo "[setup] installing lightning-snapshot and its test and docs dependencies (torch pinned by constraints.txt)" >&2
  LOG="$VENV/install.log"
  if ! { "$VENV/bin/python" -m pip install --upgrade pip &&
         "$VENV/bin/python" -m pip install -c "$ROOT/constraints.txt" torch==2.13.0 &&
         "$VENV/bin/python" -m pip install -c "$ROOT/constraints.txt" -e "$ROOT[test,docs]"; } >"$LOG" 2>&1; then
    tail -n 40 "$LOG" >&2
    echo "[setup] installation failed; the full log is $LOG" >&2
    exit 1
  fi
  rm -f "$VENV"/.installed-*
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
