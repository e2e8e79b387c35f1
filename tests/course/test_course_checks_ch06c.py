"""Chapter 06c's check, ``check_lru_evict``, accepts the reference and rejects the typical mistakes.

Each wrong ``lru_evict`` below is a mistake a learner makes; the check must raise
AssertionError on it with a message that names the mistake."""

from __future__ import annotations

from course_fixtures import rejects

from mini_vllm.course import check_lru_evict


def make_lru_evict(
    *,
    order=lambda policy, key: (policy.ranks[key], key),
    candidates=lambda policy, protected: [key for key in policy.evictable if key not in protected],
    partial=False,
    remove_first=False,
    keys_only=False,
    remove=True,
    newest_first=False,
):
    """A learner's answer, right unless one mistake is switched on."""

    def lru_evict(policy, n, protected):
        keys = sorted(candidates(policy, protected), key=lambda key: order(policy, key), reverse=newest_first)
        chosen = [(key, policy.chunks[key]) for key in keys[:n]]
        if remove_first:  # removes, then finds out there are not enough
            for key, _ in chosen:
                policy.remove(key)
        if len(keys) < n and not partial:
            return None
        if remove and not remove_first:
            for key, _ in chosen:
                policy.remove(key)
        return [key if keys_only else (key, chunk) for key, chunk in chosen]

    return lru_evict


def test_the_reference_and_a_learners_answer_pass(capsys):
    from mini_vllm.kv_offload.lru import lru_evict

    check_lru_evict(lru_evict)
    check_lru_evict(make_lru_evict())
    assert capsys.readouterr().out.count("✓ lru_evict") == 2


def test_evicting_a_protected_chunk_is_named():
    wrong = make_lru_evict(candidates=lambda policy, protected: list(policy.evictable))
    rejects(check_lru_evict, wrong, "which is protected")


def test_evicting_a_chunk_being_loaded_or_stored_is_named():
    wrong = make_lru_evict(candidates=lambda policy, protected: [k for k in policy.chunks if k not in protected])
    rejects(check_lru_evict, wrong, "which is being loaded")


def test_evicting_the_most_recent_is_named():
    rejects(check_lru_evict, make_lru_evict(newest_first=True), "these are the most recently used")


def test_comparing_the_ranks_first_number_only_is_named():
    wrong = make_lru_evict(order=lambda policy, key: (policy.ranks[key][0], -policy.ranks[key][1], key))
    rejects(check_lru_evict, wrong, "compare the whole pair")


def test_ignoring_the_key_on_a_tie_is_named():
    wrong = make_lru_evict(order=lambda policy, key: (policy.ranks[key], [-b for b in key]))
    rejects(check_lru_evict, wrong, "chunks of equal rank go by their key")


def test_a_partial_eviction_is_named():
    rejects(check_lru_evict, make_lru_evict(partial=True), "all or nothing")


def test_a_refusal_that_changed_the_policy_is_named():
    rejects(check_lru_evict, make_lru_evict(remove_first=True), "returned None but changed the policy")


def test_returning_keys_not_pairs_is_named():
    rejects(check_lru_evict, make_lru_evict(keys_only=True), "not (key, chunk) pairs")


def test_leaving_the_evicted_chunks_in_the_policy_is_named():
    rejects(check_lru_evict, make_lru_evict(remove=False), "policy.remove(key) does all three")


def test_none_for_nothing_to_evict_is_named():
    def none_for_zero(policy, n, protected):
        return None if n == 0 else make_lru_evict()(policy, n, protected)

    rejects(check_lru_evict, none_for_zero, "None is only for 'fewer than n candidates'")


def test_changing_the_protected_set_is_named():
    def takes_protected(policy, n, protected):
        evicted = make_lru_evict()(policy, n, protected)
        protected.clear()
        return evicted

    rejects(check_lru_evict, takes_protected, "changed the protected set")


def test_calling_the_policys_evict_is_named():
    rejects(check_lru_evict, lambda policy, n, protected: policy.evict(n, protected), "called policy.evict")


def test_the_wrong_chunk_with_the_right_key_is_named():
    def wrong_chunk(policy, n, protected):
        evicted = make_lru_evict()(policy, n, protected)
        return evicted and [(key, type(chunk)(chunk.chunk_id + 100)) for key, chunk in evicted]

    rejects(check_lru_evict, wrong_chunk, "pair each key with its own chunk")


def test_another_order_is_named_with_the_order_to_sort_by():
    wrong = make_lru_evict(order=lambda policy, key: policy.chunks[key].chunk_id)  # the order they were stored in
    rejects(check_lru_evict, wrong, "sort the candidates by (policy.ranks[key], key) and evict the first n")


def test_protected_is_shown_as_the_set_it_is():
    wrong = make_lru_evict(candidates=lambda policy, protected: list(policy.evictable))
    message = rejects(check_lru_evict, wrong, "protected={'a'})")
    assert "protected=['a']" not in message
    assert "protected=set())" in rejects(check_lru_evict, make_lru_evict(newest_first=True), "most recently used")


def test_the_chunks_printed_say_which_number_is_which():
    message = rejects(check_lru_evict, make_lru_evict(remove=False), "policy.remove(key) does all three")
    assert "'a': 'chunk_id 1, ref_cnt 0'" in message, message


def test_between_random_calls_loads_and_stores_start_and_finish_in_policy_evictable():
    """The check's random policies change between calls as the tier's do: a chunk is in ``policy.evictable``
    exactly when its ref_cnt is 0, and chunks go busy and idle again from one call to the next."""
    import random

    from mini_vllm.course.offload_checks import _random_specs, _transfers_start_and_finish, make_policy

    rng, went_busy, went_idle = random.Random(0), 0, 0
    for _ in range(50):
        specs = _random_specs(rng)
        policies = [make_policy(specs), make_policy(specs)]
        before = set(policies[0].evictable)
        _transfers_start_and_finish(rng, policies)
        for policy in policies:
            assert policy.evictable == {key for key, chunk in policy.chunks.items() if chunk.ref_cnt == 0}
        assert policies[0].evictable == policies[1].evictable
        went_busy += len(before - policies[0].evictable)
        went_idle += len(policies[0].evictable - before)
    assert went_busy > 0 and went_idle > 0


def test_a_part_made_by_exec_is_not_kept_and_says_why(tmp_path, monkeypatch, capsys):
    # exec(...) in a notebook makes a function no cell holds the source of: inspect raised OSError from keep().
    from mini_vllm.course import kept_parts
    from mini_vllm.course.parts import PARTS_ENV

    monkeypatch.setenv(PARTS_ENV, str(tmp_path / "parts"))
    notebook = {"__name__": "__main__"}  # a notebook's globals: its functions are the learner's
    exec(
        "def lru_evict(policy, n, protected):\n"
        "    candidates = sorted((policy.ranks[k], k) for k in policy.evictable if k not in protected)\n"
        "    if len(candidates) < n:\n"
        "        return None\n"
        "    evicted = [(k, policy.chunks[k]) for _, k in candidates[:n]]\n"
        "    for k, _ in evicted:\n"
        "        policy.remove(k)\n"
        "    return evicted\n",
        notebook,
    )
    check_lru_evict(notebook["lru_evict"])
    out = capsys.readouterr().out
    assert "✓ lru_evict" in out
    assert "not kept as your part 'lru_evict': lru_evict has no source to keep (it was made by exec(...)" in out, out
    assert "define it with def lru_evict(...) in a cell" in out
    assert kept_parts() == []
