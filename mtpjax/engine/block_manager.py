"""Paged-KV block allocator with reference counts and prefix caching.

Every action has a check with exactly the same arithmetic (`can_allocate`/`allocate`,
`can_append`/`may_append`, `can_fork`/`fork`). An action the check refuses raises
`NoFreeBlocksError` and changes nothing. Bad input raises `ValueError` naming the value.

Arithmetic (B = block_size, T = seq.num_tokens):
    allocate(seq, L)    block table covers ceil((T + L) / B) blocks, prefix-cache hits included
    may_append(seq, n)  block table covers ceil((T + n) / B) blocks (crossing several boundaries
                        at once when n = K + 1 tokens arrive); never shrinks

Prefix caching: a block is registered under the chained hash of its tokens only once it is full of
COMMITTED tokens (seq.num_computed_tokens covers it); drafts never reach the hash. Free blocks
that still hold a registered hash stay reusable until evicted, least recently freed first.
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np

from mtpjax.engine.sequence import Sequence


class NoFreeBlocksError(RuntimeError):
    """An allocation was refused for lack of free blocks; allocator state is unchanged."""


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None        # set iff this block is the registered owner of `hash`
        self.token_ids: tuple[int, ...] = ()  # tokens of a registered block (diagnostics)

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, cached={self.hash is not None})"


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Owns `num_blocks` KV blocks of `block_size` token slots each.

    `num_hash_lookahead_tokens` (E, default 0): a block's hash also covers the E tokens after it,
    and it is registered only once those exist. Set E = D when the MTP modules' KV lives in the same
    block table: MTP module k's KV at position i depends on token x_{i+k}, so without E a cached
    block's last slots could hold MTP KV computed for a different continuation (drafts would
    differ, outputs stay lossless).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, *,
                 num_hash_lookahead_tokens: int = 0):
        for name, value, lo in (("num_blocks", num_blocks, 1), ("block_size", block_size, 1),
                                ("num_hash_lookahead_tokens", num_hash_lookahead_tokens, 0)):
            if not _is_int(value) or value < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {name}={value!r}")
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.num_hash_lookahead_tokens = int(num_hash_lookahead_tokens)
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        # Free, no hash: handed out first.
        self._free: collections.deque[int] = collections.deque(range(self.num_blocks))
        # Free, still registered (ref_count 0): reusable by a hit, evicted oldest-freed first.
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.hash_to_block: dict[bytes, int] = {}
        self._num_used = 0
        # prefix-cache hits taken by allocate() since creation (blocks whose KV was reused)
        self.num_prefix_hit_blocks = 0

    # ---- counts ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: never-used/unregistered ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self._num_used

    @property
    def num_cached_blocks(self) -> int:
        return len(self.hash_to_block)

    def num_blocks_for(self, num_tokens: int) -> int:
        return _cdiv(num_tokens, self.block_size)

    # ---- hashing -----------------------------------------------------------------------------
    @staticmethod
    def hash_block(prev: bytes | None, token_ids) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        if prev is not None:
            h.update(prev)
        h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
        return h.digest()

    def _block_key_tokens(self, seq: Sequence, i: int) -> list[int]:
        b = self.block_size
        return seq.token_ids[i * b:(i + 1) * b + self.num_hash_lookahead_tokens]

    def _prefix_hits(self, seq: Sequence) -> list[tuple[int, bytes]]:
        """(block_id, hash) of the leading blocks of `seq` found in the cache. Pure.

        A hit never covers the last token of the prefill (`seq.prefill_target`): its KV must
        be computed to get logits (or, for a resuming request, the hidden state that drafts).
        """
        if not self.enable_prefix_caching:
            return []
        b, e = self.block_size, self.num_hash_lookahead_tokens
        hits: list[tuple[int, bytes]] = []
        prev = None
        last = getattr(seq, "prefill_target", seq.num_tokens) - 1
        for i in range(seq.num_tokens // b):
            end = (i + 1) * b
            if end > last or end + e > seq.num_tokens:
                break
            h = self.hash_block(prev, self._block_key_tokens(seq, i))
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            hits.append((block_id, h))
            prev = h
        return hits

    def num_prefix_cached_tokens(self, seq: Sequence) -> int:
        """Tokens that `allocate(seq)` would take from the prefix cache right now. Pure."""
        return len(self._prefix_hits(seq)) * self.block_size

    # ---- internal block moves ----------------------------------------------------------------
    def _take_fresh(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:  # evict the least recently freed cached block
            block_id, _ = self._evictable.popitem(last=False)
            block = self.blocks[block_id]
            del self.hash_to_block[block.hash]
            block.hash, block.token_ids = None, ()
        block = self.blocks[block_id]
        assert block.ref_count == 0, block
        block.ref_count = 1
        self._num_used += 1
        return block_id

    def _take_hit(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._evictable[block_id]
            self._num_used += 1
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, block
        block.ref_count -= 1
        if block.ref_count == 0:
            self._num_used -= 1
            if block.hash is not None:
                self._evictable[block_id] = None   # most recently freed: evicted last
            else:
                self._free.append(block_id)

    # ---- allocate ----------------------------------------------------------------------------
    def _check_lookahead(self, name: str, value: int) -> int:
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {name}={value!r}")
        return int(value)

    def _num_allocate_blocks(self, seq: Sequence, num_lookahead_tokens: int):
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks "
                             f"(block_table={seq.block_table}); deallocate it first")
        hits = self._prefix_hits(seq)
        num_needed = self.num_blocks_for(seq.num_tokens + num_lookahead_tokens)
        num_hits_in_use = sum(1 for block_id, _ in hits if self.blocks[block_id].ref_count > 0)
        # Evictable hits leave the free pool, fresh blocks come out of it: N - hits_in_use <= free.
        return hits, num_needed, num_needed - num_hits_in_use

    def can_allocate(self, seq: Sequence, num_lookahead_tokens: int = 0) -> bool:
        num_lookahead_tokens = self._check_lookahead("num_lookahead_tokens", num_lookahead_tokens)
        _, _, num_from_free = self._num_allocate_blocks(seq, num_lookahead_tokens)
        return num_from_free <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_lookahead_tokens: int = 0) -> None:
        """Give `seq` a block table for its tokens plus `num_lookahead_tokens` more slots.

        Sets seq.num_cached_tokens = seq.num_computed_tokens = tokens covered by prefix hits.
        """
        num_lookahead_tokens = self._check_lookahead("num_lookahead_tokens", num_lookahead_tokens)
        hits, num_needed, num_from_free = self._num_allocate_blocks(seq, num_lookahead_tokens)
        if num_from_free > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"sequence {seq.seq_id} needs {num_from_free} free blocks, "
                f"{self.num_free_blocks} are free")
        table = []
        for block_id, _ in hits:
            self._take_hit(block_id)
            table.append(block_id)
        while len(table) < num_needed:
            table.append(self._take_fresh())
        seq.block_table = table
        seq.block_hashes = [h for _, h in hits]
        seq.num_cached_tokens = len(hits) * self.block_size
        self.num_prefix_hit_blocks += len(hits)
        seq.num_computed_tokens = seq.num_cached_tokens

    # ---- append ------------------------------------------------------------------------------
    def _num_append_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        if not seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} holds no blocks; allocate it first")
        needed = self.num_blocks_for(seq.num_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        num_new_tokens = self._check_lookahead("num_new_tokens", num_new_tokens)
        return self._num_append_blocks(seq, num_new_tokens) <= self.num_free_blocks

    def may_append(self, seq: Sequence, num_new_tokens: int = 1) -> None:
        """Grow the block table to ceil((num_tokens + num_new_tokens) / block_size) blocks."""
        num_new_tokens = self._check_lookahead("num_new_tokens", num_new_tokens)
        n = self._num_append_blocks(seq, num_new_tokens)
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(f"sequence {seq.seq_id} needs {n} more blocks, "
                                    f"{self.num_free_blocks} are free")
        for _ in range(n):
            seq.block_table.append(self._take_fresh())

    # ---- commit (hash registration) ----------------------------------------------------------
    def commit(self, seq: Sequence) -> int:
        """Register every block of `seq` that is now full of committed tokens. Returns how many
        new hashes this sequence's chain gained. Call after seq.num_computed_tokens advanced."""
        b, e = self.block_size, self.num_hash_lookahead_tokens
        if seq.num_computed_tokens > len(seq.block_table) * b:
            raise ValueError(
                f"sequence {seq.seq_id} has num_computed_tokens={seq.num_computed_tokens} but its "
                f"{len(seq.block_table)} blocks hold only {len(seq.block_table) * b} tokens")
        if seq.num_computed_tokens > seq.num_tokens:
            raise ValueError(f"sequence {seq.seq_id} has num_computed_tokens="
                             f"{seq.num_computed_tokens} > num_tokens={seq.num_tokens}")
        if not self.enable_prefix_caching:
            return 0
        num_full = min(seq.num_computed_tokens // b, max(0, seq.num_tokens - e) // b)
        added = 0
        for i in range(len(seq.block_hashes), num_full):
            prev = seq.block_hashes[-1] if seq.block_hashes else None
            h = self.hash_block(prev, self._block_key_tokens(seq, i))
            seq.block_hashes.append(h)
            added += 1
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.hash_to_block:
                block.hash, block.token_ids = h, tuple(seq.token_ids[i * b:(i + 1) * b])
                self.hash_to_block[h] = block.block_id
            # else: already registered (a hit), or another block caches the same content.
        return added

    register_full_blocks = commit

    # ---- free --------------------------------------------------------------------------------
    def deallocate(self, seq: Sequence) -> None:
        """Drop `seq`'s references; tail blocks are freed first, so they are evicted first."""
        if not seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} holds no blocks (block_table=[])")
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_cached_tokens = 0
        seq.num_computed_tokens = 0

    def reset(self, keep_prefix_cache: bool = True) -> None:
        """Recovery after an engine step failed part-way: every block becomes unreferenced, as if
        each holder had been deallocated (the caller has dropped every block table: no sequence
        may hold blocks afterwards). Registered blocks hold committed KV and stay reusable when
        `keep_prefix_cache`; pass False when the KV cache itself was lost. Repairs any
        half-done move (a block taken but not yet in a table, a half-registered hash)."""
        old_free, old_evictable = list(self._free), list(self._evictable)
        for h, block_id in list(self.hash_to_block.items()):
            if not keep_prefix_cache or self.blocks[block_id].hash != h:
                del self.hash_to_block[h]
        for block in self.blocks:
            block.ref_count = 0
            if block.hash is not None and self.hash_to_block.get(block.hash) != block.block_id:
                block.hash, block.token_ids = None, ()
        # keep the old free / LRU order, then what was in use, in block order
        order = list(dict.fromkeys(old_free + old_evictable + list(range(self.num_blocks))))
        self._free = collections.deque(b for b in order if self.blocks[b].hash is None)
        self._evictable = collections.OrderedDict(
            (b, None) for b in order if self.blocks[b].hash is not None)
        self._num_used = 0

    # ---- fork --------------------------------------------------------------------------------
    def _num_fork_blocks(self, seq: Sequence) -> tuple[int, int]:
        if not seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} holds no blocks; cannot fork it")
        num_shared = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        return num_shared, len(seq.block_table) - num_shared

    def can_fork(self, seq: Sequence) -> bool:
        return self._num_fork_blocks(seq)[1] <= self.num_free_blocks

    def fork(self, seq: Sequence, seq_id: int | None = None) -> Sequence:
        """A new RUNNING-ready sequence with `seq`'s tokens, sharing (ref_count + 1) every block
        that is full of committed tokens and owning fresh blocks for the rest of the table.
        Its seq_len is the shared prefix; the rest must be recomputed (it is a prefill)."""
        num_shared, num_fresh = self._num_fork_blocks(seq)
        if num_fresh > self.num_free_blocks:
            raise NoFreeBlocksError(f"fork of sequence {seq.seq_id} needs {num_fresh} free blocks, "
                                    f"{self.num_free_blocks} are free")
        child = Sequence(seq.token_ids, sampling_params=seq.sampling_params, seq_id=seq_id)
        child.num_prompt_tokens = seq.num_prompt_tokens
        for block_id in seq.block_table[:num_shared]:
            self._take_hit(block_id)
        child.block_table = seq.block_table[:num_shared] + [self._take_fresh() for _ in range(num_fresh)]
        child.block_hashes = list(seq.block_hashes[:num_shared])
        child.num_cached_tokens = child.num_computed_tokens = num_shared * self.block_size
        return child

    # ---- invariants (tests) ------------------------------------------------------------------
    def check_invariants(self, seqs=None) -> None:
        """Assert internal consistency; with `seqs` (all holders), also that ref counts match."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "block twice in the free list"
        assert not (free & evictable), "block both free and evictable"
        used = {b.block_id for b in self.blocks if b.ref_count > 0}
        assert all(b.ref_count >= 0 for b in self.blocks)
        assert not (used & (free | evictable)), "referenced block in a free pool"
        assert len(used) + len(free) + len(evictable) == self.num_blocks, "block leaked"
        assert len(used) == self._num_used
        assert self.num_free_blocks + self.num_used_blocks == self.num_blocks
        for block_id in free:
            assert self.blocks[block_id].hash is None
        for block_id in evictable:
            assert self.blocks[block_id].hash is not None
        for h, block_id in self.hash_to_block.items():
            assert self.blocks[block_id].hash == h
        assert sum(b.hash is not None for b in self.blocks) == len(self.hash_to_block)
        if seqs is not None:
            refs = collections.Counter()
            for s in seqs:
                assert len(set(s.block_table)) == len(s.block_table), f"seq {s.seq_id} repeats a block"
                refs.update(s.block_table)
            for b in self.blocks:
                assert refs[b.block_id] == b.ref_count, (b, refs[b.block_id])
