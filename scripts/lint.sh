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
# sizes are reported, never failed: a file over 800 lines is worth a look (does it hold more than one concern?), and
# the place to cut it is where a concern ends (docs/architecture.md, "Where a file is cut")
long=$(find lightning_snapshot backends benchmarks -name '*.py' -exec wc -l {} + | awk '$2 != "total" && $1 > 800')
if [ -n "$long" ]; then
  echo "[lint] note: over 800 lines (does the file hold more than one concern?):" >&2
  echo "$long" >&2
fi
# no module imports another module's private names: a name used across modules is public within the package (ruff's
# PLC2701 checks imports from other packages, with # noqa where Lightning's private API is the only way; this walk
# checks the package's own modules, which ruff counts as one package)
echo "[lint] private names across modules" >&2
python - <<'PY' || status=1
import ast, pathlib, sys
bad = []
for f in sorted([*pathlib.Path("lightning_snapshot").rglob("*.py"), *pathlib.Path("backends").rglob("*.py")]):
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_snapshot"):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    bad.append(f"{f}:{node.lineno}: imports {alias.name} from {node.module}")
        if isinstance(node, ast.ImportFrom | ast.Import):
            mods = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            for mod in mods:
                if mod.startswith("lightning_snapshot") and any(p.startswith("_") for p in mod.split(".")):
                    bad.append(f"{f}:{node.lineno}: imports the private module {mod}")
if bad:
    print("a private name used outside its module (make it public within the package, or move the code):",
          *bad, sep="\n  ", file=sys.stderr)
    sys.exit(1)
PY
# the ranks agree on an outcome in one place (comm.agree_on): no flag collective, raise-together or gather of
# errors written by hand elsewhere (docs/architecture.md, "Agreement")
echo "[lint] agreement" >&2
raw=$(grep -rnE --include='*.py' '\.all_true(_each)?\(|raise_together\(|\.all_gather\(\(.*(error|problem)' \
  lightning_snapshot backends | grep -v '^lightning_snapshot/dist/comm.py:' || true)
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
