"""What the tier's settings say: vLLM's ``kv_transfer_config``, read as its ``CPUOffloadingSpec`` reads it.

In vLLM 0.33, ``--kv-offloading-size`` (with the ``native`` backend) fills a
``KVTransferConfig`` for the ``OffloadingConnector``; anything more about the
tier goes in that config's ``kv_connector_extra_config``, which the CPU spec
reads. The eviction policy is one of those keys::

    vllm serve MODEL --kv-offloading-size 64 \\
        --kv-transfer-config '{"kv_connector_extra_config": {"eviction_policy": "arc"}}'
    LLM(kv_offloading_size=64, kv_transfer_config={"kv_connector_extra_config": {"eviction_policy": "arc"}})

mini-vLLM takes the same two spellings (``serve --kv-transfer-config``,
``LLM(kv_transfer_config=...)``, as a dict) and reads from them what its tier
has: the eviction policy. What it does not build is refused by name, not
ignored: another connector or role, vLLM's other extra keys
(``store_threshold``, ``cache_policy_module_path``, ...) and the other
``KVTransferConfig`` fields (those of disaggregated serving). One of them,
``kv_load_failure_policy``, is taken when it says what the tier does: a
failed load is recomputed (``"recompute"``); vLLM 0.33's default, ``"fail"``
(the request ends with an error), is not built here.

A file-system tier below the CPU tier is vLLM's ``TieringOffloadingSpec``,
chosen by two extra keys, ``spec_name`` and ``secondary_tiers``, with one tier
of ``type`` ``"fs"`` (``fs_tier_settings``)::

    LLM(kv_offloading_size=1, kv_transfer_config={"kv_connector_extra_config": {
        "spec_name": "TieringOffloadingSpec",
        "secondary_tiers": [{"type": "fs", "root_dir": "/tmp/kv", "enable_kv_events": True}]}})

``root_dir`` is required; ``enable_kv_events`` (default False) lets the tier
publish its stores. vLLM's other tier types (``"p2p"``, ``"obj"``, ...), a
second tier, and the fs tier's thread counts and backpressure are refused
by name. vLLM's ``CPUOffloadingSpec`` (the default ``spec_name``) ignores
``secondary_tiers``: here that silent mix-up is a ValueError.

vLLM equivalent: ``vllm/config/kv_transfer.py`` (``KVTransferConfig``),
``VllmConfig._post_init_kv_transfer_config`` (``vllm/config/vllm.py``) and
``CPUOffloadingSpec`` (``vllm/v1/kv_offload/cpu/spec.py``: ``eviction_policy``,
"lru" when left out), ``TieringOffloadingSpec`` (``vllm/v1/kv_offload/tiering/spec.py``)
and the ``fs`` tier's constructor arguments (``tiering/fs/manager.py``).
"""

from __future__ import annotations

import os
from typing import Any

from ..validation import one_of
from .cpu_manager import CACHE_POLICIES

DEFAULT_EVICTION_POLICY = "lru"  # vLLM 0.33's CPUOffloadingSpec default

# What kv_offloading_size makes vLLM set (VllmConfig._post_init_kv_transfer_config): given, they must say the same.
OFFLOADING_VALUES = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
# What the tier does with a failed load (OffloadingConnector.load_kv): given, it must say so.
TIER_VALUES = {"kv_load_failure_policy": "recompute"}
EXTRA_CONFIG = "kv_connector_extra_config"
EXTRA_KEYS = ("eviction_policy", "spec_name", "secondary_tiers")
TIERING_SPEC_NAME = "TieringOffloadingSpec"  # vLLM's spec with secondary tiers; its default is CPUOffloadingSpec
FS_TIER_TYPE = "fs"
FS_TIER_KEYS = ("type", "root_dir", "enable_kv_events")


def eviction_policy(kv_transfer_config: dict[str, Any] | None) -> str:
    """The tier's eviction policy that ``kv_transfer_config`` names ("lru" or "arc"; "lru" when it names none).

    A ValueError (TypeError for a value that is not a dict) names anything
    mini-vLLM's tier does not have.
    """
    if kv_transfer_config is None:
        return DEFAULT_EVICTION_POLICY
    if not isinstance(kv_transfer_config, dict):
        raise TypeError(
            f"kv_transfer_config must be a dict (vLLM's KVTransferConfig fields), got "
            f"{type(kv_transfer_config).__name__} {kv_transfer_config!r}"
        )
    unknown = sorted(set(kv_transfer_config) - {*OFFLOADING_VALUES, *TIER_VALUES, EXTRA_CONFIG})
    if unknown:
        raise ValueError(
            f"kv_transfer_config: {unknown} not built here: mini-vLLM's only connector is the offloading "
            f"tier, configured by {EXTRA_CONFIG} (its keys: {list(EXTRA_KEYS)})"
        )
    for name, value in {**OFFLOADING_VALUES, **TIER_VALUES}.items():
        given = kv_transfer_config.get(name)
        if given is not None and given != value:
            what = "a failed load is recomputed here" if name in TIER_VALUES else "the offloading tier"
            raise ValueError(f"kv_transfer_config: {name} must be {value!r} ({what}), got {given!r}")
    extra = kv_transfer_config.get(EXTRA_CONFIG) or {}
    if not isinstance(extra, dict):
        raise TypeError(f"kv_transfer_config: {EXTRA_CONFIG} must be a dict, got {type(extra).__name__} {extra!r}")
    unknown = sorted(set(extra) - set(EXTRA_KEYS))
    if unknown:
        raise ValueError(
            f"kv_transfer_config: {EXTRA_CONFIG} key(s) {unknown} not built here; mini-vLLM's tier reads "
            f"{list(EXTRA_KEYS)} (its size is kv_offloading_size)"
        )
    policy = extra.get("eviction_policy", DEFAULT_EVICTION_POLICY)
    if policy not in CACHE_POLICIES:
        raise ValueError(f"kv_transfer_config: eviction_policy must be {one_of(CACHE_POLICIES)}, got {policy!r}")
    fs_tier_settings(kv_transfer_config)  # a ValueError naming a bad secondary tier, at configuration time
    return policy


def fs_tier_settings(kv_transfer_config: dict[str, Any] | None) -> dict[str, Any] | None:
    """The file-system tier that ``kv_transfer_config`` asks for (``root_dir``, ``enable_kv_events``), or None.

    Call ``eviction_policy`` first: it checks the rest of the config.
    """
    extra = (kv_transfer_config or {}).get(EXTRA_CONFIG) or {}
    spec_name = extra.get("spec_name")
    tiers = extra.get("secondary_tiers")
    if spec_name is not None and spec_name != TIERING_SPEC_NAME:
        raise ValueError(
            f"kv_transfer_config: spec_name must be {TIERING_SPEC_NAME!r} (the CPU tier with secondary tiers), "
            f"got {spec_name!r}"
        )
    if tiers is None:
        if spec_name is not None:
            raise ValueError(f"kv_transfer_config: spec_name {TIERING_SPEC_NAME!r} needs secondary_tiers")
        return None
    if spec_name is None:
        raise ValueError(
            f"kv_transfer_config: secondary_tiers needs spec_name {TIERING_SPEC_NAME!r} in {EXTRA_CONFIG} "
            "(vLLM's default spec, CPUOffloadingSpec, would ignore the tiers)"
        )
    if not isinstance(tiers, list) or len(tiers) != 1 or not isinstance(tiers[0], dict):
        raise ValueError(
            f"kv_transfer_config: secondary_tiers must be a list of one tier, "
            f'[{{"type": {FS_TIER_TYPE!r}, "root_dir": ...}}], got {tiers!r}'
        )
    tier = tiers[0]
    if tier.get("type") != FS_TIER_TYPE:
        raise ValueError(
            f"kv_transfer_config: secondary tier type {tier.get('type')!r} not built here; the only one is "
            f"{FS_TIER_TYPE!r} (a file system)"
        )
    unknown = sorted(set(tier) - set(FS_TIER_KEYS))
    if unknown:
        raise ValueError(f"kv_transfer_config: fs tier key(s) {unknown} not built here; it reads {list(FS_TIER_KEYS)}")
    root_dir = tier.get("root_dir")
    if not isinstance(root_dir, str) or not root_dir:
        raise ValueError(f"kv_transfer_config: the fs tier needs root_dir, a folder's path, got {root_dir!r}")
    enable_kv_events = tier.get("enable_kv_events", False)
    if not isinstance(enable_kv_events, bool):
        raise ValueError(f"kv_transfer_config: enable_kv_events must be true or false, got {enable_kv_events!r}")
    return {"root_dir": os.path.expanduser(root_dir), "enable_kv_events": enable_kv_events}
