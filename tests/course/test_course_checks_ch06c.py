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
