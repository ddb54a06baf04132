#!/usr/bin/env bash
# Build an sdist and a wheel of every colibri distribution into dist/ and check them.
#
#   tools/build_dists.sh [PYTHON]        (PYTHON: an interpreter with `build` and `twine`;
#                                         default: python3; `pip install -e '.[test]'` brings both)
#
# Distributions are discovered, not listed: the root pyproject.toml (colibri-core) and
# every families/*, backends/*, plugins/*, models/* directory holding a pyproject.toml. colibri-core's
# wheel is a platform wheel when a C compiler builds its kernels (setup.py makes them
# optional); its sdist installs without a compiler too, with numpy dequantisation.
# Nothing is uploaded: see docs/releasing.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${1:-python3}"
OUT="$PWD/dist"
rm -rf "$OUT"
mkdir -p "$OUT"
dists=(.)
for d in families/*/ backends/*/ plugins/*/ models/*/; do
    [ -f "$d/pyproject.toml" ] && dists+=("${d%/}")
done
for d in "${dists[@]}"; do
    echo "building $d" >&2
    # a copy without build leftovers or editable-install metadata: what a clean checkout builds
    "$PYTHON" -m build --outdir "$OUT" "$d" >&2
done
"$PYTHON" -m twine check --strict "$OUT"/*
