#!/usr/bin/env bash
# The checks that need a GPU, in one short run (used on a lent H200; see README):
# the engine on the compiled Triton backend equals the torch backend, the model
# equals transformers on CUDA, and the quick benchmark. Results go to $OUT.
OUT=${OUT:-build/gpu}; mkdir -p "$OUT"
set -x
export PYTHONPATH=$PWD
python -c "import torch, triton, transformers, sys; print(sys.version, torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"
timeout 90 python -m pytest -q -x -p no:cacheprovider tests/kernels/test_engine_triton.py tests/engine/test_model.py tests/kernels/test_kernels_backend.py 2>&1 | tail -5
timeout 150 python -m mini_vllm bench --quick --device cuda --json "$OUT/bench-gpu-quick.json" 2>&1 | grep -v "it/s\|s/it" | tail -16
