"""Radix index of cached prefixes over page-sized token blocks (sglang's radix cache, at page granularity).

Each node is one full page of PAGE_TOKENS tokens (its key: that block's token ids) under the node of the
previous block; it holds one reference to its page. match() finds the longest cached prefix of a prompt:
whole pages, then the longest common start of one more page (the caller copies that page on its first write,
copy-on-write at the first differing page). insert() adds the full pages a sequence has computed. When the
pool is short, evict() drops least-recently-used leaves whose page nobody else holds.
"""
from __future__ import annotations

import itertools

from .kv_pool import PAGE_TOKENS, KVPool


class _Node:
    __slots__ = ("key", "page", "parent", "children", "last_used")

    def __init__(self, key, page, parent):
        self.key, self.page, self.parent = key, page, parent
        self.children: dict[tuple, _Node] = {}
        self.last_used = 0


class PrefixCache:
    def __init__(self, pool: KVPool):
        self.pool = pool
        self.root = _Node((), -1, None)
        self._clock = itertools.count(1)
        self.n_nodes = 0
        pool.evict = self.evict

    def _touch(self, node: _Node):
        t = next(self._clock)
        while node is not None and node.page >= 0:
            node.last_used = t
            node = node.parent

    def match(self, ids, limit: int) -> tuple[list[int], int]:
        """(pages, n_tokens): cached pages covering ids[:n_tokens], n_tokens <= limit. Each returned page
        gets a reference for the caller. The last page may be only partly matched (n_tokens % PAGE_TOKENS)."""
        node, pages, n = self.root, [], 0
        while n + PAGE_TOKENS <= limit:
            child = node.children.get(tuple(ids[n: n + PAGE_TOKENS]))
            if child is None:
                break
            node = child
            pages.append(child.page)
            n += PAGE_TOKENS
        rest = ids[n: min(limit, n + PAGE_TOKENS)]
        best, best_j = None, 0
        if rest:
            for key, child in node.children.items():
                j = 0
                while j < len(rest) and key[j] == rest[j]:
                    j += 1
                if j > best_j:
                    best, best_j = child, j
        if best is not None:
            node = best
            pages.append(best.page)
            n += best_j
        self._touch(node)
        for p in pages:
            self.pool.incref(p)
        return pages, n

    def insert(self, ids, pages, n_full: int):
        """Index the first n_full full pages of a sequence (token ids, page table pages). A block already in
        the index keeps its page; when that is not the sequence's own (two sequences computed the same prefix side by
        side), the sequence's later pages are not indexed: under a page it does not hold they would keep that page
        from being evicted while the sequence runs, after admission counted it as free to take (n_evictable). So a
        page the index alone holds has no descendant a running sequence holds."""
        node = self.root
        for b in range(n_full):
            key = tuple(ids[b * PAGE_TOKENS: (b + 1) * PAGE_TOKENS])
            child = node.children.get(key)
            if child is None:
                child = _Node(key, pages[b], node)
                node.children[key] = child
                self.pool.incref(pages[b])
                self.n_nodes += 1
            elif child.page != pages[b]:
                break
            node = child
        self._touch(node)

    def _evictable_leaves(self):
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif self.pool.refs[n.page] == 1:
                out.append(n)
        return out

    def n_evictable(self) -> int:
        """Pages held only by the index: all of them can be freed, leaves first (insert() keeps a page a running
        sequence holds from hanging under one the index alone holds)."""
        c, stack = 0, list(self.root.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            c += int(self.pool.refs[n.page] == 1)
        return c

    def evict(self, n: int) -> int:
        """Free up to n pages, least recently used leaves first. Returns how many were freed."""
        freed = 0
        while freed < n:
            leaves = self._evictable_leaves()
            if not leaves:
                break
            leaves.sort(key=lambda x: x.last_used)
            for leaf in leaves:
                if freed >= n:
                    break
                del leaf.parent.children[leaf.key]
                self.pool.decref(leaf.page)
                self.n_nodes -= 1
                freed += 1
        return freed

    def clear(self):
        self.evict(self.pool.n_pages)
