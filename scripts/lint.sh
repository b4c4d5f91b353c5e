#!/usr/bin/env bash
# Lint the package in the project's own virtual environment: ruff (lint and format check) and mypy on
# lightning_snapshot/ and backends/, and import-linter's layering contracts. Fails on any finding.
# `bash scripts/lint.sh --fix` applies ruff's safe fixes and
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
# no benchmark module over 800 lines: a file that grows past it holds more than one job (docs/architecture.md)
echo "[lint] file length" >&2
long=$(find lightning_snapshot backends benchmarks -name '*.py' -exec wc -l {} + | awk '$2 != "total" && $1 > 800')
if [ -n "$long" ]; then
  echo "over 800 lines (split by concern):" >&2
  echo "$long" >&2
  status=1
fi
# the package: no module over 600 lines and no class over 300 (the callback's hooks: 400), headroom for the next fixes
echo "[lint] module and class size" >&2
python - <<'PY' || status=1
import ast, pathlib, sys
bad = []
for f in sorted([*pathlib.Path("lightning_snapshot").rglob("*.py"), *pathlib.Path("backends").rglob("*.py")]):
    src = f.read_text()
    if len(src.splitlines()) > 600:
        bad.append(f"{f}: {len(src.splitlines())} lines (at most 600)")
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ClassDef):
            size, most = node.end_lineno - node.lineno + 1, 400 if node.name == "SnapshotCallback" else 300
            if size > most:
                bad.append(f"{f}: class {node.name} is {size} lines (at most {most})")
if bad:
    print("split by concern (docs/architecture.md):", *bad, sep="\n  ", file=sys.stderr)
    sys.exit(1)
PY
# the ranks agree on an outcome in one place (comm.agree_on): no flag collective, raise-together or gather of
# errors written by hand elsewhere (docs/architecture.md, "Agreement")
echo "[lint] agreement" >&2
raw=$(grep -rnE --include='*.py' '\.all_true(_each)?\(|raise_together\(|\.all_gather\(\(.*(error|problem)' \
  lightning_snapshot backends | grep -v '^lightning_snapshot/comm.py:' || true)
if [ -n "$raw" ]; then
  echo "a flag collective written by hand (use comm.agree_on):" >&2
  echo "$raw" >&2
  status=1
fi
# import-linter reads the package from disk as it is installed: a copy with backends/ at lightning_snapshot/backends
# (it does not follow the links of the mypy tree). The contracts are [tool.importlinter] in pyproject.toml.
echo "[lint] import-linter" >&2
LAYERS="$ROOT/build/import-linter"
rm -rf "$LAYERS"
mkdir -p "$LAYERS"
cp -r "$ROOT/lightning_snapshot" "$LAYERS/"
rm -rf "$LAYERS/lightning_snapshot/backends"
cp -r "$ROOT/backends" "$LAYERS/lightning_snapshot/backends"
find "$LAYERS" -name __pycache__ -prune -exec rm -rf {} +
cp "$ROOT/pyproject.toml" "$LAYERS/"
(cd "$LAYERS" && PYTHONPATH="$LAYERS" lint-imports --no-cache) || status=1
exit $status
