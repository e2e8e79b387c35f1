"""One mini-vLLM replica and one real vLLM replica behind ``vllm-router``: the router cannot tell them apart.

Both publish their KV events on ZMQ (``--kv-events-config``) and render requests for the
router (``--enable-scale-out``); with one ``PYTHONHASHSEED`` the router's ``kv_aware`` policy
sends a tenant cached on either replica to that replica every time.
"""

from __future__ import annotations

import pytest

from mini_vllm.tools.compare_vllm import vllm_missing_reason, vllm_python
from mini_vllm.tools.fleet import Fleet, router_binary, router_missing_reason, tenant_conversations, warm_then_route
from prerequisites import missing

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def test_kv_aware_routes_a_tenant_to_its_replica_whichever_engine_it_runs(tmp_path):
    if vllm_python() is None:
        missing("vllm", vllm_missing_reason())
    if router_binary() is None:
        missing("vllm-router", router_missing_reason())
    conversations = tenant_conversations(num_tenants=2, requests_per_tenant=4)
    with Fleet(num_mini=1, num_vllm=1, log_dir=tmp_path) as fleet:
        fleet.start_router("kv_aware")
        assert [replica.kind for replica in fleet.replicas] == ["mini", "vllm"]
        for index in range(2):
            results, served = warm_then_route(fleet, index, [m for t, m in conversations if t == index])
            assert [r["status"] for r in results] == [200] * 3, results
            assert all(r["cached_tokens"] >= 64 for r in results), results
            assert served == [3 if i == index else 0 for i in range(2)], fleet.replicas[index].kind
