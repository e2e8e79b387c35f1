"""Differential test: the fs tier's file names against vLLM 0.33's own ``FileMapper``, byte for byte.

mini-vLLM's ``FileMapper`` (``mini_vllm/kv_offload/file_mapper.py``) and
vLLM's (``vllm/v1/kv_offload/file_mapper.py``, run in ``.venv-vllm`` with
vLLM 0.33.0's Python files first on its path, in one subprocess) name the
same keys, for a few settings (a model id with a ``/``, block sizes, dtypes,
hybrid-style layer lists, a second KV-cache group's keys): the block files,
the ``config.json`` path and the run config written in it must be equal.
vLLM's side is built as its fs tier builds it, with ``parallel_agnostic=True``
on a single process, and ``inference_engine="mini-vllm"``, the name mini-vLLM
writes there. The settings are then changed one at a time on mini-vLLM's side:
each change must move the files to another folder.

Time: about 1 s for the comparison; the subprocess imports vLLM's file mapper
(torch comes with it): 20 s on a busy 2-core machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess

import pytest

from mini_vllm.kv_offload import make_offload_key
from mini_vllm.kv_offload.file_mapper import FileMapper
from prerequisites import missing, under_ci
from test_vs_vllm_kv_cache_manager import VLLM_PYTHON, release_source

RELEASE = "0.33.0"
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
SETTINGS = [
    {
        "root_dir": "kv_files",
        "model_name": "Qwen/Qwen3-0.6B",
        "tokens_per_hash": 16,
        "dtype": "torch.bfloat16",
        "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": LAYERS}],
    },
    {
        "root_dir": "kv files/x y",
        "model_name": "models/tiny",
        "tokens_per_hash": 32,
        "dtype": "torch.float32",
        "kv_cache_groups": [{"tokens_per_block": 32, "layer_names": LAYERS[:1]}],
    },
    {
        "root_dir": "rel",
        "model_name": "m",
        "tokens_per_hash": 4,
        "dtype": "torch.float16",
        "kv_cache_groups": [
            {"tokens_per_block": 4, "layer_names": LAYERS[::2]},
            {"tokens_per_block": 4, "layer_names": LAYERS[1:2]},
        ],
    },
]
KEYS = [make_offload_key(hashlib.sha256(str(i).encode()).digest(), i % 3) for i in range(8)]

VLLM_SIDE = """
import json, sys
from vllm.v1.kv_offload.file_mapper import FileMapper
request = json.load(sys.stdin)
answers = []
for settings in request["settings"]:
    mapper = FileMapper(
        root_dir=settings["root_dir"], model_name=settings["model_name"], tokens_per_hash=settings["tokens_per_hash"],
        blocks_per_file=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, rank=0, dtype=settings["dtype"],
        kv_cache_groups=settings["kv_cache_groups"], inference_engine="mini-vllm", parallel_agnostic=True,
    )
    answers.append({
        "files": [mapper.get_file_name(bytes.fromhex(key)) for key in request["keys"]],
        "config_file": mapper.get_config_file_path(),
        "run_config": mapper.get_run_config(),
    })
print(json.dumps(answers))
"""


def mini_side(settings: dict) -> dict:
    mapper = FileMapper(**settings)
    return {
        "files": [mapper.get_file_name(key) for key in KEYS],
        "config_file": mapper.get_config_file_path(),
        "run_config": mapper.get_run_config(),
    }


@pytest.fixture(scope="module")
def vllm_answers() -> list[dict]:
    if not VLLM_PYTHON.exists():
        missing("vllm", "no .venv-vllm: run `make vllm` to install vLLM for the differential test")
    env = {**os.environ, "PYTHONPATH": str(release_source(RELEASE, ci=under_ci())), "VLLM_LOGGING_LEVEL": "ERROR"}
    request = json.dumps({"settings": SETTINGS, "keys": [key.hex() for key in KEYS]})
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", VLLM_SIDE], input=request, capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("index", range(len(SETTINGS)))
def test_mini_vllm_names_files_as_vllms_file_mapper(vllm_answers, index):
    assert mini_side(SETTINGS[index]) == vllm_answers[index]


@pytest.mark.parametrize(
    "change",
    [
        {"model_name": "other/model"},
        {"tokens_per_hash": 8},
        {"dtype": "torch.float32"},
        {"kv_cache_groups": [{"tokens_per_block": 16, "layer_names": LAYERS[:2]}]},
        {"inference_engine": "vllm"},
    ],
)
def test_each_setting_moves_the_files_and_the_comparison_sees_it(vllm_answers, change):
    changed = mini_side({**SETTINGS[0], **change})
    assert changed != vllm_answers[0]
    assert {os.path.dirname(os.path.dirname(os.path.dirname(path))) for path in changed["files"]}.isdisjoint(
        os.path.dirname(os.path.dirname(os.path.dirname(path))) for path in vllm_answers[0]["files"]
    )
