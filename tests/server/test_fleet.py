"""Two mini-vLLM replicas behind the real ``vllm-router`` (``mini_vllm/tools/fleet.py``).

The router's ``kv_aware`` policy reads each replica's KV events over ZMQ and tokenizes
requests through the replicas' render endpoints, as it does for vLLM replicas: a tenant
cached on one replica is routed there every time; a replica that resets its cache
(``AllBlocksCleared``) is no longer credited with it; over a multi-tenant chat ``kv_aware``
hits the cache more often than ``round_robin``; a killed replica is routed around, and no
client is left without an answer.
"""

from __future__ import annotations

import time

import httpx
import pytest

from mini_vllm.tools.fleet import (
    Fleet,
    read_counters,
    router_binary,
    router_command,
    router_missing_reason,
    run_chat_workload,
    run_course_router,
    stream_one,
    tenant_conversations,
    warm_then_route,
)
from prerequisites import missing

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    if router_binary() is None:
        missing("vllm-router", router_missing_reason())
    with Fleet(2, log_dir=tmp_path_factory.mktemp("fleet")) as fleet:
        fleet.start_router("kv_aware")
        yield fleet


@pytest.fixture
def client():
    with httpx.Client(timeout=120, trust_env=False) as client:
        yield client


def served(fleet, before) -> list[int]:
    return [int(a["requests"] - b["requests"]) for a, b in zip(fleet.counters(), before)]


def test_a_tenant_cached_on_one_replica_is_routed_there_every_time(fleet):
    fleet.reset_prefix_caches()
    conversations = tenant_conversations(num_tenants=2, requests_per_tenant=5)
    for index in range(2):  # tenant i warmed on replica i, past the router; then 4 requests through it
        results, served = warm_then_route(fleet, index, [messages for t, messages in conversations if t == index])
        assert [r["status"] for r in results] == [200] * 4
        assert all(r["cached_tokens"] >= 64 for r in results), results  # the tenant's system prompt, from cache
        assert served == [4 if i == index else 0 for i in range(2)]


def test_a_replica_that_resets_its_cache_is_credited_with_nothing_any_more(fleet, client):
    fleet.reset_prefix_caches()
    [(_, first), (_, second), (_, third)] = tenant_conversations(num_tenants=1, requests_per_tenant=3)
    for replica in fleet.replicas:  # cached on both
        assert stream_one(client, replica.url, first, max_tokens=1)["status"] == 200
    time.sleep(0.3)
    before = fleet.counters()
    stream_one(client, fleet.url, second, max_tokens=1)
    chosen = served(fleet, before).index(1)  # the router's choice between two equal caches
    httpx.post(fleet.replicas[chosen].url + "/reset_prefix_cache", timeout=60, trust_env=False)
    time.sleep(0.3)  # its AllBlocksCleared reaches the router
    before = fleet.counters()
    for _ in range(3):
        assert stream_one(client, fleet.url, third, max_tokens=1)["status"] == 200
    assert served(fleet, before) == [0 if i == chosen else 3 for i in range(2)]


def test_kv_aware_beats_round_robin_on_fleet_hit_rate(fleet):
    runs = {}
    for policy in ("round_robin", "kv_aware"):
        fleet.start_router(policy)
        runs[policy] = run_chat_workload(fleet, num_tenants=3, requests_per_tenant=3, max_tokens=2)
        assert all(r["status"] == 200 and not r["error"] for r in runs[policy].results), runs[policy].results
    print({policy: run.row() for policy, run in runs.items()})
    assert runs["round_robin"].requests_per_replica in ([5, 4], [4, 5])
    assert runs["kv_aware"].hit_rate > runs["round_robin"].hit_rate + 0.1


def test_the_course_router_fed_by_the_same_zmq_streams_keeps_each_tenant_on_one_replica(fleet):
    # Chapter 09b's CacheAwareRouter, reading what vllm-router reads: the replicas' events on ZMQ
    # (vLLM's wire form of the hashes, their PYTHONHASHSEED) and their render endpoints.
    run = run_course_router(fleet, num_tenants=3, requests_per_tenant=3)
    assert all(r["status"] == 200 and not r["error"] for r in run.results), run.results
    tenants = [t for t, _ in tenant_conversations(3, 3)]
    for tenant in set(tenants):
        assert len({r["replica"] for t, r in zip(tenants, run.results) if t == tenant}) == 1, run.results
    later = [r["cached_tokens"] for t, r in zip(tenants, run.results)][3:]  # each tenant's 2nd and 3rd request
    assert all(cached >= 64 for cached in later), later
    assert sorted(run.requests_per_replica) != [0, 9]  # three tenants, two replicas: both get some


def test_the_router_listens_where_it_is_told(tmp_path):
    # make fleet FLEET_ARGS="2 --host 0.0.0.0 --port 8000": a room reaches the router, not just this machine.
    command = router_command("round_robin", [], host="0.0.0.0", port=8000, block_size=32)  # no replica started
    assert command[command.index("--host") + 1 :][:3] == ["0.0.0.0", "--port", "8000"]


def test_a_killed_replica_is_routed_around_and_every_client_gets_an_answer(fleet, client):
    fleet.start_router("kv_aware")
    conversations = [messages for _, messages in tenant_conversations(num_tenants=2, requests_per_tenant=3)]
    for messages in conversations[:2]:
        assert stream_one(client, fleet.url, messages, max_tokens=1)["status"] == 200
    fleet.kill(1)
    results = [stream_one(client, fleet.url, messages, max_tokens=2) for messages in conversations[2:]]
    # Every request is answered: a completion, or an HTTP error saying why; none is dropped silently.
    assert all(r["status"] != 0 for r in results), results
    assert all(r["status"] == 200 or r["error"] for r in results), results
    time.sleep(2.5)  # the router's health check (every second) marks the dead replica down
    survivor = fleet.replicas[0].url
    before = read_counters(survivor)
    late = [stream_one(client, fleet.url, messages, max_tokens=2) for messages in conversations[:4]]
    assert [r["status"] for r in late] == [200] * 4, late
    assert read_counters(survivor)["requests"] - before["requests"] == 4
