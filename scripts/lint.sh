#!/usr/bin/env bash
# Lint the package in the project's own virtual environment: ruff (lint and format check) and mypy on
# lightning_snapshot/ and backends/. Fails on any finding. `bash scripts/lint.sh --fix` applies ruff's safe fixes and
# formats first.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
DIRS=(lightning_snapshot backends)
if [ "${1:-}" = "--fix" ]; then
  ruff check --fix "${DIRS[@]}"
  ruff format "${DIRS[@]}"
fi
status=0
echo "[lint] ruff check" >&2
ruff check "${DIRS[@]}" || status=1
echo "[lint] ruff format --check" >&2
ruff format --check "${DIRS[@]}" || status=1
# mypy cannot see the package-dir mapping (lightning_snapshot.backends lives in backends/): it checks a tree of
# links that has that layout, and the paths it reports are mapped back to the checkout's
echo "[lint] mypy" >&2
TREE="$ROOT/build/mypy"
rm -rf "$TREE/lightning_snapshot"
mkdir -p "$TREE/lightning_snapshot"
for entry in "$ROOT"/lightning_snapshot/*; do
  [ "$(basename "$entry")" = "__pycache__" ] || ln -s "$entry" "$TREE/lightning_snapshot/"
done
ln -s "$ROOT/backends" "$TREE/lightning_snapshot/backends"
(cd "$TREE" && mypy --config-file "$ROOT/pyproject.toml" --cache-dir "$TREE/.mypy_cache" -p lightning_snapshot) |
  sed -e 's#^lightning_snapshot/backends/#backends/#' || status=1
exit $status
