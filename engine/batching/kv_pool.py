"""The paged KV cache: one pool of fixed-size pages shared by all sequences, with reference counts.

A page holds PAGE_TOKENS (= the key cache's 32-position transposed block) consecutive positions of one sequence
for every layer and KV head:
    k[layer, page] : [n_kv, head_dim, 32]   (keys transposed, as simd.ops.attention_paged reads them)
    v[layer, page] : [n_kv, 32, head_dim]
    (kv_dtype q8: k and v [n_kv, q8_block_bytes(head_dim)] int8 each, the values then 32 f32 scales)
Every holder of a page (a sequence's page table, a node of the prefix index) owns one reference; a page whose
count drops to 0 goes back to the free list. Writes only ever go to a page with count 1 (copy_on_write makes
one). The pool also books reservations: pages promised to admitted sequences, so an admitted sequence can
always get the pages it needs and a request that cannot be promised its pages waits instead.
Not thread-safe: only the scheduler thread touches it.
"""
from __future__ import annotations

import numpy as np

from ...simd import _ops as ops

from ..errors import BitNetError

PAGE_TOKENS = ops.KEY_BLOCK


class KVPool:
    def __init__(self, n_layers: int, n_pages: int, n_kv: int, head_dim: int, kv_dtype: str = "f16"):
        if kv_dtype not in ("f16", "f32", "q8"):
            raise BitNetError(f"kv_dtype {kv_dtype!r}: expected 'f16', 'f32' or 'q8'")
        if n_pages < 1:
            raise BitNetError(f"KV pool of {n_pages} pages: needs at least one")
        if kv_dtype == "q8" and (head_dim % 4 or head_dim > ops.Q8_MAX_HEAD_DIM):
            raise BitNetError(f"--kv q8: head_dim {head_dim} is not a multiple of 4 up to {ops.Q8_MAX_HEAD_DIM}",
                              hint="use --kv f16")
        self.n_pages, self.kv_dtype = int(n_pages), kv_dtype
        # np.zeros maps untouched memory lazily: unused pages cost no RSS
        if kv_dtype == "q8":   # int8 blocks + a scale per position per KV head (simd/ops/attention_q8.h)
            self.k = np.zeros((n_layers,) + ops.paged_q8_pool_shape(n_pages, n_kv, head_dim), np.int8)
            self.v = np.zeros((n_layers,) + ops.paged_q8_pool_shape(n_pages, n_kv, head_dim), np.int8)
        else:
            dt = np.uint16 if kv_dtype == "f16" else np.float32
            self.k = np.zeros((n_layers,) + ops.paged_key_pool_shape(n_pages, n_kv, head_dim), dt)
            self.v = np.zeros((n_layers,) + ops.paged_value_pool_shape(n_pages, n_kv, head_dim), dt)
        self.refs = np.zeros(n_pages, np.int32)
        self._free = list(range(n_pages - 1, -1, -1))  # a stack: low page ids first
        self.reserved = 0                                # pages promised to admitted sequences
        self.evict = None                                # callable(n) -> pages freed (the prefix index)

    @staticmethod
    def bytes_per_token(n_layers: int, n_kv: int, head_dim: int, kv_dtype: str = "f16") -> int:
        """K and V bytes of one position in the pool (q8: int8 values + a 4-byte scale per KV head: 0.52x f16 at
        head_dim 128, so a pool of the same bytes holds 1.94x the tokens)."""
        per_head = {"f16": 2 * head_dim, "f32": 4 * head_dim, "q8": head_dim + 4}[kv_dtype]
        return 2 * n_layers * n_kv * per_head

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def n_used(self) -> int:
        return self.n_pages - len(self._free)

    def alloc(self) -> int:
        """A fresh page (count 1); evicts cached prefixes when the free list is empty. Raises if none."""
        if not self._free and self.evict is not None:
            self.evict(1)
        if not self._free:
            raise BitNetError("KV pool exhausted (a scheduler reservation bug)")
        p = self._free.pop()
        self.refs[p] = 1
        return p

    def incref(self, p: int):
        if self.refs[p] <= 0:
            raise AssertionError(f"incref of free page {p}")
        self.refs[p] += 1

    def decref(self, p: int):
        r = self.refs[p] - 1
        if r < 0:
            raise AssertionError(f"decref of free page {p}")
        self.refs[p] = r
        if r == 0:
            self._free.append(p)

    def copy_on_write(self, p: int) -> int:
        """A page the caller may write: p itself when it is the only holder, else a copy (p loses a ref)."""
        if self.refs[p] == 1:
            return p
        q = self.alloc()
        self.k[:, q] = self.k[:, p]
        self.v[:, q] = self.v[:, p]
        self.decref(p)
        return q
