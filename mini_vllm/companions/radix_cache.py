"""A radix-tree prefix cache in the style of SGLang's ``RadixCache`` (chapter 06b).

vLLM and SGLang answer the same question — "which prefix of this prompt is already
in the KV cache?" — with two different data structures:

* vLLM keeps a flat **hash map**: every full block gets a hash that chains over all
  the tokens before it, and a lookup probes the map block by block until the first
  miss (``KVCacheManager.find_longest_cache_hit``, chapter 05).
* SGLang keeps a **radix tree** (``python/sglang/srt/mem_cache/radix_cache.py``):
  every cached prefix is a path from the root, each edge labelled with a run of
  tokens, and a lookup walks down the tree comparing tokens.

This module is a small, readable radix cache with SGLang's names (``TreeNode``,
``match_prefix``, ``insert``, ``evict``, ``inc_lock_ref`` / ``dec_lock_ref``,
``page_size``), so that the chapter can send the same workload through both. It
stores no K/V: SGLang's node ``value`` holds the KV-pool slots of the node's
tokens, and here only the number of tokens matters. Capacity is counted in tokens.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class TreeNode:
    """One edge of the tree and the node it leads to.

    ``key`` is the run of tokens on the edge from ``parent`` to this node (empty only
    for the root). ``children`` maps the first page of each child's key to the child.
    ``lock_ref`` counts the running requests whose prefix passes through this node: a
    locked node is never evicted. ``last_access_time`` is the cache's logical clock at
    the last lookup or insert that went through the node (for LRU eviction).
    """

    key: tuple[int, ...]
    parent: TreeNode | None = None
    children: dict[tuple[int, ...], "TreeNode"] = field(default_factory=dict)
    lock_ref: int = 0
    last_access_time: int = 0
    node_id: int = 0  # creation order: breaks ties between equally old leaves

    @property
    def is_leaf(self) -> bool:
        return not self.children


class RadixCache:
    """A prefix cache that stores token runs in a radix tree, evicting LRU leaves.

    Owns the tree (``root`` and every ``TreeNode`` below it), the logical clock, and
    two counters of the work lookups did: ``num_nodes_visited`` and
    ``num_tokens_compared``.

    Invariants (``check_invariants`` asserts them):

    * every node but the root has a non-empty key whose length is a multiple of
      ``page_size``; the children of a node start with different pages;
    * ``num_cached_tokens`` is the sum of all key lengths and never exceeds
      ``capacity_tokens``;
    * a node's ``lock_ref`` is at least the sum of its children's (locking a node
      locks the whole path to the root).

    Matching is by whole pages: with ``page_size=1`` (SGLang's default) a lookup can
    match any number of tokens; with ``page_size=16`` it matches whole 16-token
    pages, like vLLM's blocks.
    """

    def __init__(self, capacity_tokens: int, page_size: int = 1) -> None:
        if not isinstance(capacity_tokens, int) or isinstance(capacity_tokens, bool) or capacity_tokens <= 0:
            raise ValueError(f"capacity_tokens must be a positive integer, got {capacity_tokens!r}")
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0:
            raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
        self.capacity_tokens = capacity_tokens
        self.page_size = page_size
        self._node_ids = itertools.count(1)
        self.root = TreeNode(key=())
        self.root.lock_ref = 1  # the root is never evicted
        self.num_cached_tokens = 0
        self.num_evicted_tokens = 0
        self.num_nodes_visited = 0
        self.num_tokens_compared = 0
        self._clock = 0

    @property
    def num_free_tokens(self) -> int:
        return self.capacity_tokens - self.num_cached_tokens

    # ------------------------------------------------------------------ lookup

    def match_prefix(self, token_ids: Sequence[int]) -> tuple[int, TreeNode]:
        """Find the longest cached prefix of ``token_ids``.

        Returns the number of matched tokens (a multiple of ``page_size``) and the
        node where the match ends; pass that node to ``inc_lock_ref`` to keep the
        prefix while a request uses it. When the match ends inside an edge, the
        edge is split there (as SGLang does), so that the returned node covers
        exactly the matched tokens. Every node on the path counts as used now.
        """
        token_ids = self._check_tokens(token_ids)
        self._clock += 1
        node, num_matched = self.root, 0
        while True:
            node.last_access_time = self._clock
            page = tuple(token_ids[num_matched : num_matched + self.page_size])
            child = node.children.get(page) if len(page) == self.page_size else None
            if child is None:
                return num_matched, node
            self.num_nodes_visited += 1
            common = self._common_length(child.key, token_ids, num_matched)
            if common < len(child.key):
                if common > 0:
                    child = self._split_node(child, common)
                    child.last_access_time = self._clock
                    num_matched += common
                    return num_matched, child
                return num_matched, node
            num_matched += common
            node = child

    def _common_length(self, key: tuple[int, ...], token_ids: list[int], start: int) -> int:
        """Tokens of ``key`` equal to ``token_ids[start:]``, rounded down to whole pages."""
        length = 0
        for expected, actual in zip(key, token_ids[start:]):
            self.num_tokens_compared += 1
            if expected != actual:
                break
            length += 1
        return length - length % self.page_size

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut ``child``'s edge after ``split_len`` tokens; return the new middle node."""
        parent = child.parent
        assert parent is not None
        middle = TreeNode(
            key=child.key[:split_len],
            parent=parent,
            lock_ref=child.lock_ref,
            last_access_time=child.last_access_time,
            node_id=next(self._node_ids),
        )
        parent.children[middle.key[: self.page_size]] = middle
        child.key = child.key[split_len:]
        child.parent = middle
        middle.children[child.key[: self.page_size]] = child
        return middle

    # ------------------------------------------------------------------ insert

    def insert(self, token_ids: Sequence[int]) -> int:
        """Cache the whole pages of ``token_ids`` (tokens a request has computed).

        Walks the cached part, then adds the rest as one new leaf, evicting
        least-recently-used leaves first to make room. If even that cannot make
        room (everything else is locked), only the pages that fit are stored.
        Returns the number of tokens newly stored.
        """
        token_ids = self._check_tokens(token_ids)
        token_ids = token_ids[: len(token_ids) - len(token_ids) % self.page_size]
        num_matched, node = self.match_prefix(token_ids)
        new_tokens = token_ids[num_matched:]
        if not new_tokens:
            return 0
        self.inc_lock_ref(node)  # the path we extend must survive the eviction
        self.evict(len(new_tokens) - self.num_free_tokens)
        self.dec_lock_ref(node)
        fits = min(len(new_tokens), self.num_free_tokens)
        new_tokens = new_tokens[: fits - fits % self.page_size]
        if not new_tokens:
            return 0
        leaf = TreeNode(
            key=tuple(new_tokens),
            parent=node,
            last_access_time=self._clock,
            node_id=next(self._node_ids),
        )
        node.children[leaf.key[: self.page_size]] = leaf
        self.num_cached_tokens += len(new_tokens)
        return len(new_tokens)

    # ------------------------------------------------------------------ locks

    def inc_lock_ref(self, node: TreeNode) -> None:
        """A running request uses the prefix ending at ``node``: protect the path."""
        while node is not None and node is not self.root:
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """The request that locked ``node`` is done with it."""
        while node is not None and node is not self.root:
            if node.lock_ref <= 0:
                raise ValueError("dec_lock_ref on a node that is not locked")
            node.lock_ref -= 1
            node = node.parent

    # ------------------------------------------------------------------ eviction

    def evict(self, num_tokens: int) -> int:
        """Evict unlocked leaves, least recently used first, until ``num_tokens`` are free.

        Only leaves are evicted, so every cached token stays reachable from the root;
        a parent whose last child goes becomes a leaf and a candidate itself. Whole
        leaves go (possibly more tokens than asked). Returns the tokens evicted.
        """
        if num_tokens <= 0:
            return 0
        heap = [(leaf.last_access_time, leaf.node_id, leaf) for leaf in self._evictable_leaves()]
        heapq.heapify(heap)
        evicted = 0
        while evicted < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[: self.page_size]]
            evicted += len(leaf.key)
            if parent is not self.root and parent.is_leaf and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access_time, parent.node_id, parent))
        self.num_cached_tokens -= evicted
        self.num_evicted_tokens += evicted
        return evicted

    def _evictable_leaves(self) -> list[TreeNode]:
        return [node for node in self._all_nodes() if node.is_leaf and node.lock_ref == 0]

    # ------------------------------------------------------------------ inspection

    def _all_nodes(self) -> list[TreeNode]:
        """Every node but the root, parents before children."""
        nodes, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def cached_sequences(self) -> list[tuple[int, ...]]:
        """The token sequence of every leaf's path (every cached prefix is a prefix of one)."""
        sequences = []

        def walk(node: TreeNode, prefix: tuple[int, ...]) -> None:
            prefix = prefix + node.key
            if node.is_leaf and node is not self.root:
                sequences.append(prefix)
            for child in node.children.values():
                walk(child, prefix)

        walk(self.root, ())
        return sorted(sequences)

    def pretty(self, decode=None, max_chars: int = 40) -> str:
        """The tree as indented text, one node per line: its token count and its text.

        ``decode`` turns a node's token ids into text (for example a tokenizer's
        ``decode``); without it the first token ids are shown.
        """
        lines = [f"(root) {self.num_cached_tokens} tokens cached"]

        def label(node: TreeNode) -> str:
            if decode is not None:
                text = decode(list(node.key)).replace("\n", "⏎")
            else:
                text = " ".join(map(str, node.key))
            return text if len(text) <= max_chars else text[: max_chars - 1] + "…"

        def walk(node: TreeNode, depth: int) -> None:
            for child in sorted(node.children.values(), key=lambda n: n.key):
                lock = f", locked ×{child.lock_ref}" if child.lock_ref else ""
                lines.append(f"{'    ' * depth}└─ {len(child.key):>4} tokens{lock}: {label(child)!r}")
                walk(child, depth + 1)

        walk(self.root, 0)
        return "\n".join(lines)

    def check_invariants(self) -> None:
        """Assert the class invariants (for tests; O(number of nodes))."""
        total = 0
        for node in self._all_nodes():
            assert node.key, "only the root may have an empty key"
            assert len(node.key) % self.page_size == 0, "keys are whole pages"
            assert node.parent is not None and node.parent.children.get(node.key[: self.page_size]) is node
            assert node.lock_ref >= sum(child.lock_ref for child in node.children.values())
            total += len(node.key)
        assert total == self.num_cached_tokens, (total, self.num_cached_tokens)
        assert self.num_cached_tokens <= self.capacity_tokens

    @staticmethod
    def _check_tokens(token_ids: Sequence[int]) -> list[int]:
        if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
            raise TypeError(f"token_ids must be a sequence of ints, got {type(token_ids).__name__}")
        token_ids = list(token_ids)
        for token in token_ids:
            if not isinstance(token, int) or isinstance(token, bool):
                raise TypeError(f"token_ids must contain ints, got {token!r}")
        return token_ids


# ---------------------------------------------------------------------- the comparison


def serve_with_radix_cache(cache: RadixCache, token_ids: Sequence[int]) -> int:
    """Serve one prompt through a radix cache the way SGLang's scheduler does (no model).

    Look up the prompt without its last token (that token's logits give the first
    output token, so it is always computed), lock the matched prefix while the
    request "runs", cache the whole prompt, unlock. Returns the tokens reused.
    """
    token_ids = list(token_ids)
    num_cached, node = cache.match_prefix(token_ids[:-1])
    cache.inc_lock_ref(node)
    cache.insert(token_ids)
    cache.dec_lock_ref(node)
    return num_cached


def serve_with_hash_map(manager, token_ids: Sequence[int], request_id: str) -> int:
    """Serve one prompt through mini-vLLM's ``KVCacheManager`` (vLLM's hash map; no model).

    ``schedule_whole_prompt`` finds the cached full blocks (capped so that the last
    block is recomputed), takes them and caches the prompt's full blocks, and
    ``free`` returns everything to the free queue, last block first.
    Returns the tokens reused.
    """
    # Kept local: this module needs nothing else from the engine.
    from ..request import Request
    from ..scheduler import schedule_whole_prompt

    request = Request(request_id, list(token_ids), block_size=manager.block_size)
    num_cached = schedule_whole_prompt(manager, request)
    if num_cached is None:
        raise ValueError(f"a pool of {manager.num_blocks} blocks cannot hold a {request.num_tokens}-token prompt")
    manager.free(request)
    return num_cached
