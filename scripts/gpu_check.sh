#!/usr/bin/env bash
# The checks that need a GPU, in one short run that fits one lent device call (under 10 minutes;
# see README "Using a GPU"). Each step has its own time limit and goes on when one fails; the
# summary at the end says which passed. Results go to $OUT.
#   1. the Triton kernels compiled for the GPU against their references, sliding windows and
#      int64 offsets included (tests/kernels/);
#   2. the engine on the compiled Triton backend equals the torch backend, on the bundled model
#      and on the hybrid one (sliding-window and full-attention layers), and the model equals
#      transformers on CUDA;
#   3. the dashboard draws a CUDA engine's pool after a run;
#   4. the quick benchmark.
OUT=${OUT:-build/gpu}; mkdir -p "$OUT"
export PYTHONPATH=$PWD OMP_NUM_THREADS=1
declare -A RESULT

step() {  # step NAME SECONDS COMMAND...
  local name=$1 seconds=$2; shift 2
  echo "== $name"
  if timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1; then RESULT[$name]=passed; else RESULT[$name]="FAILED (rc $?)"; fi
  grep -v "it/s\|s/it" "$OUT/$name.log" | tail -8
}

python -c "import torch, triton, transformers, sys; print(sys.version, torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"

step kernels 180 python -m pytest -q -x -p no:cacheprovider \
  tests/kernels/test_kernels_store_kv.py tests/kernels/test_kernels_attention.py \
  tests/kernels/test_sliding_window_attention.py tests/kernels/test_kernels_int64_offsets.py

step engine 150 python -m pytest -q -x -p no:cacheprovider \
  tests/kernels/test_engine_triton.py tests/kernels/test_kernels_backend.py tests/engine/test_model.py

step hybrid_and_dashboard 120 python - <<'EOF'
from mini_vllm import LLM, SamplingParams
from mini_vllm.model import hybrid_model_path
from mini_vllm.viz.dashboard import EngineDashboard

prompts = ["Once upon a time " * 20, "Once upon a time " * 20 + "there was", "A paged cache"]
params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
tokens = {}
for backend in ("torch", "triton"):
    llm = LLM(hybrid_model_path(), device="cuda", attention_backend=backend)
    dashboard = EngineDashboard(llm, min_interval=0.0) if backend == "triton" else None
    tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    if dashboard is not None:
        text = dashboard.to_text()
        assert dashboard._live.last_error is None, dashboard._live.last_error
        assert "block" in text, text
        print(text[:1500])
        dashboard.close()
assert tokens["torch"] == tokens["triton"], tokens
print("hybrid model: the same greedy tokens on the compiled Triton backend as on torch")
EOF

step bench 150 python -m mini_vllm bench --quick --device cuda --json "$OUT/bench-gpu-quick.json"

echo "== summary"
for name in kernels engine hybrid_and_dashboard bench; do echo "$name: ${RESULT[$name]}"; done
for name in kernels engine hybrid_and_dashboard bench; do [ "${RESULT[$name]}" = passed ] || exit 1; done
