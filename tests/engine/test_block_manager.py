"""BlockManager: allocation arithmetic at block boundaries, prefix caching, and a stateful property
test over random allocate / append / advance+commit / free / fork sequences."""

import copy

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mtpjax.engine import BlockManager, NoFreeBlocksError, Sequence


def seq_of(n, start=100):
    return Sequence(list(range(start, start + n)))


def snapshot(bm, seqs=()):
    return (
        tuple(bm._free), tuple(bm._evictable), dict(bm.hash_to_block), bm._num_used,
        tuple((b.ref_count, b.hash, b.token_ids) for b in bm.blocks),
        tuple((s.seq_id, tuple(s.block_table), tuple(s.block_hashes), s.num_cached_tokens,
               s.num_computed_tokens, s.num_tokens) for s in seqs),
    )


def decode_step(bm, seq, new_tokens, num_reserved=None):
    """One verify step committing `new_tokens` (pending token's KV + accepted drafts' KV)."""
    bm.may_append(seq, len(new_tokens) if num_reserved is None else num_reserved)
    seq.num_computed_tokens = seq.num_tokens - 1 + len(new_tokens)
    seq.append_tokens(new_tokens)
    bm.commit(seq)


def prefill(bm, seq, lookahead=0):
    bm.allocate(seq, lookahead)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)


# ---------------------------------------------------------------------------------------------
# can_allocate / allocate
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "num_tokens, lookahead, num_blocks, ok, table_len",
    [
        (12, 0, 3, True, 3),    # exact fit: 3 full blocks of 4
        (13, 0, 3, False, None),  # one token over a boundary: one block short
        (11, 1, 3, True, 3),    # lookahead fills the last block exactly
        (11, 2, 3, False, None),  # lookahead crosses into a 4th block
        (1, 0, 1, True, 1),
        (1, 3, 1, True, 1),
        (1, 4, 1, False, None),
        (5, 7, 3, True, 3),     # lookahead spanning two boundaries
        (5, 8, 3, False, None),
    ])
def test_allocate_boundaries(num_tokens, lookahead, num_blocks, ok, table_len):
    bm = BlockManager(num_blocks, 4)
    seq = seq_of(num_tokens)
    assert bm.can_allocate(seq, lookahead) is ok
    before = snapshot(bm, [seq])
    if ok:
        bm.allocate(seq, lookahead)
        assert len(seq.block_table) == table_len
        assert bm.num_free_blocks == num_blocks - table_len
    else:
        with pytest.raises(NoFreeBlocksError):
            bm.allocate(seq, lookahead)
        assert snapshot(bm, [seq]) == before
    bm.check_invariants([seq] if ok else [])


# ---------------------------------------------------------------------------------------------
# can_append / may_append: K + 1 tokens may cross several boundaries
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "num_tokens, num_new, free_after_alloc, new_blocks, ok",
    [
        (4, 1, 5, 1, True),    # T=4 fills block 0; one more token needs block 1
        (3, 1, 5, 0, True),    # T + 1 = 4: still inside block 0
        (5, 3, 5, 0, True),    # 8 = exact fit of 2 blocks
        (5, 4, 5, 1, True),    # 9: one boundary
        (8, 5, 5, 2, True),    # K+1 = 5 from a full boundary: crosses 2 boundaries (13 -> 4 blocks)
        (8, 5, 1, 2, False),   # ... with only one block free: refused, nothing taken
        (8, 9, 5, 3, True),    # 17 -> 5 blocks: three boundaries at once
        (7, 0, 0, 0, True),    # zero new tokens never needs a block
    ])
def test_append_boundaries(num_tokens, num_new, free_after_alloc, new_blocks, ok):
    bs = 4
    initial = -(-num_tokens // bs)
    bm = BlockManager(initial + free_after_alloc, bs)
    seq = seq_of(num_tokens)
    bm.allocate(seq)
    assert len(seq.block_table) == initial
    assert bm.can_append(seq, num_new) is ok
    before = snapshot(bm, [seq])
    if ok:
        bm.may_append(seq, num_new)
        assert len(seq.block_table) == initial + new_blocks == -(-(num_tokens + num_new) // bs) or \
            (new_blocks == 0 and len(seq.block_table) == initial)
        assert bm.num_free_blocks == free_after_alloc - new_blocks
    else:
        with pytest.raises(NoFreeBlocksError):
            bm.may_append(seq, num_new)
        assert snapshot(bm, [seq]) == before
    bm.check_invariants([seq])


def test_may_append_never_shrinks_and_is_idempotent():
    bm = BlockManager(10, 4)
    seq = seq_of(4)
    bm.allocate(seq)
    bm.may_append(seq, 5)          # reserve for K+1 = 5: ceil(9/4) = 3 blocks
    assert len(seq.block_table) == 3
    bm.may_append(seq, 5)          # same request again: nothing new
    assert len(seq.block_table) == 3
    bm.may_append(seq, 1)          # smaller request: table is kept
    assert len(seq.block_table) == 3
    assert bm.num_free_blocks == 7


def test_bad_input_raises_value_error_naming_the_value():
    bm = BlockManager(4, 4)
    seq = seq_of(3)
    with pytest.raises(ValueError, match="num_lookahead_tokens=-1"):
        bm.can_allocate(seq, -1)
    with pytest.raises(ValueError, match="num_lookahead_tokens=-2"):
        bm.allocate(seq, -2)
    with pytest.raises(ValueError, match="holds no blocks"):
        bm.can_append(seq)
    with pytest.raises(ValueError, match="holds no blocks"):
        bm.may_append(seq, 2)
    with pytest.raises(ValueError, match="holds no blocks"):
        bm.deallocate(seq)
    bm.allocate(seq)
    before = snapshot(bm, [seq])
    with pytest.raises(ValueError, match="num_new_tokens=-1"):
        bm.may_append(seq, -1)
    with pytest.raises(ValueError, match="already holds blocks"):
        bm.allocate(seq)
    seq.num_computed_tokens = 9
    with pytest.raises(ValueError, match="num_computed_tokens=9"):
        bm.commit(seq)
    seq.num_computed_tokens = 0
    assert snapshot(bm, [seq]) == before
    for bad in (dict(num_blocks=0, block_size=4), dict(num_blocks=4, block_size=0)):
        with pytest.raises(ValueError, match="=0"):
            BlockManager(**bad)


# ---------------------------------------------------------------------------------------------
# prefix caching
# ---------------------------------------------------------------------------------------------
def test_prefix_hit_after_decode_time_registration():
    bm = BlockManager(10, 4)
    a = seq_of(5)                      # prompt fills block 0 and 1 slot of block 1
    prefill(bm, a)
    assert bm.num_cached_blocks == 1   # block 0 is full of committed tokens
    a.append_token(7)                  # sampled; no KV yet (seq_len 5, T 6)
    # One verify step with K = 2 reserving K + 1 = 3: the drafts' KV is written, nothing hashed yet.
    bm.may_append(a, 3)
    assert bm.num_cached_blocks == 1
    decode_step(bm, a, [8, 9, 10], num_reserved=3)   # commits KV of positions 5, 6, 7
    assert a.num_computed_tokens == 8 and a.num_tokens == 9
    assert bm.num_cached_blocks == 2   # block 1 filled during decode and was registered

    b = Sequence(a.token_ids[:9] + [42])   # shares 2 full blocks, then diverges
    assert bm.num_prefix_cached_tokens(b) == 8
    bm.allocate(b)
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    bm.check_invariants([a, b])


def test_hit_never_covers_the_last_prompt_token():
    bm = BlockManager(10, 4)
    a = seq_of(8)
    prefill(bm, a)
    assert bm.num_cached_blocks == 2
    same = seq_of(8)                   # identical prompt, exactly 2 full blocks
    assert bm.num_prefix_cached_tokens(same) == 4   # <= num_tokens - 1 = 7
    bm.allocate(same)
    assert same.num_cached_tokens == 4
    assert same.block_table[0] == a.block_table[0] and same.block_table[1] != a.block_table[1]
    longer = seq_of(9)
    assert bm.num_prefix_cached_tokens(longer) == 8
    bm.check_invariants([a, same])


def test_uncommitted_tokens_are_never_hashed():
    bm = BlockManager(10, 4)
    a = seq_of(8)
    bm.allocate(a)
    a.num_computed_tokens = 7          # a chunk stopped one short of block 1's end
    bm.commit(a)
    assert bm.num_cached_blocks == 1
    assert bm.num_prefix_cached_tokens(seq_of(12)) == 4
    a.num_computed_tokens = 8
    bm.commit(a)
    assert bm.num_prefix_cached_tokens(seq_of(12)) == 8


def test_chained_hash_depends_on_the_whole_prefix():
    bm = BlockManager(10, 4)
    a = Sequence([1, 2, 3, 4, 5, 6, 7, 8, 0])
    prefill(bm, a)
    b = Sequence([9, 9, 9, 9, 5, 6, 7, 8, 0])   # same second block, different first block
    assert bm.num_prefix_cached_tokens(b) == 0


def test_hit_on_evictable_block_uses_a_free_block_hit_in_use_does_not():
    bm = BlockManager(3, 4)
    a = seq_of(9)                      # 3 blocks, 2 registered after prefill
    prefill(bm, a)
    assert bm.num_free_blocks == 0
    b = seq_of(9)
    assert bm.num_prefix_cached_tokens(b) == 8
    assert not bm.can_allocate(b)      # needs 1 fresh block, none free
    bm.deallocate(a)                   # 2 registered blocks become evictable, 1 plain free
    assert bm.num_free_blocks == 3 and bm.num_cached_blocks == 2
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.num_cached_tokens == 8 and bm.num_free_blocks == 0
    bm.check_invariants([b])


def test_lru_eviction_order():
    bm = BlockManager(6, 2)
    a, b = Sequence([1, 1, 1, 1, 1]), Sequence([2, 2, 2, 2, 2])
    prefill(bm, a)                     # blocks a0 a1 (+1 partial)
    prefill(bm, b)
    a_full, b_full = a.block_table[:2], b.block_table[:2]
    bm.deallocate(a)                   # freed first: a's blocks are the least recently freed
    bm.deallocate(b)
    assert bm.num_cached_blocks == 4
    # Two plain free blocks are handed out before any cached block is evicted.
    c = Sequence([3, 3, 3])
    bm.allocate(c)
    assert bm.num_cached_blocks == 4
    # Next: a's tail block is evicted first (a freed tail-first), then a's head, then b's tail.
    d = Sequence([4])
    bm.allocate(d)
    assert d.block_table == [a_full[1]]
    assert bm.num_prefix_cached_tokens(Sequence([1, 1, 1, 1, 1])) == 2
    e = Sequence([5])
    bm.allocate(e)
    assert e.block_table == [a_full[0]]
    assert bm.num_prefix_cached_tokens(Sequence([1, 1, 1, 1, 1])) == 0
    assert bm.num_prefix_cached_tokens(Sequence([2, 2, 2, 2, 2])) == 4
    # A hit takes b's blocks out of the evictable pool (f's third block is a plain one:
    # c was freed tail first, so c's tail).
    c_blocks = list(c.block_table)
    bm.deallocate(c)
    f = Sequence([2, 2, 2, 2, 2])
    bm.allocate(f)
    assert f.num_cached_tokens == 4 and f.block_table == b_full + [c_blocks[1]]
    bm.deallocate(f)
    # Plain free blocks go first (c's head, then f's unregistered tail), then b's tail, b's head.
    order = []
    for tok in (6, 7, 8, 9):
        s = Sequence([tok])
        bm.allocate(s)
        order += s.block_table
    assert order == [c_blocks[0], c_blocks[1], b_full[1], b_full[0]]
    assert bm.num_cached_blocks == 0
    bm.check_invariants(None)


def test_hash_lookahead_waits_for_following_tokens():
    bm = BlockManager(10, 4, num_hash_lookahead_tokens=1)
    a = seq_of(4)
    prefill(bm, a)                     # block 0 full and committed, but token 4 unknown
    assert bm.num_cached_blocks == 0
    a.append_token(50)                 # the sampled token now follows block 0
    bm.commit(a)
    assert bm.num_cached_blocks == 1
    assert bm.num_prefix_cached_tokens(Sequence(a.token_ids + [1])) == 4
    # Same block, different next token: MTP KV at its last slot would differ -> no hit.
    assert bm.num_prefix_cached_tokens(Sequence(a.token_ids[:4] + [51, 1])) == 0


def test_prefix_caching_disabled():
    bm = BlockManager(4, 2, enable_prefix_caching=False)
    a = seq_of(5)
    prefill(bm, a)
    assert bm.num_cached_blocks == 0
    bm.deallocate(a)
    assert bm.num_prefix_cached_tokens(seq_of(5)) == 0
    assert bm.num_free_blocks == 4


def test_fork_shares_committed_full_blocks_with_refcounts():
    bm = BlockManager(8, 4)
    a = seq_of(10)
    prefill(bm, a)                     # 3 blocks, 2 full
    child = bm.fork(a)
    assert child.block_table[:2] == a.block_table[:2]
    assert child.block_table[2] != a.block_table[2]
    assert child.num_computed_tokens == 8 and child.token_ids == a.token_ids
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    bm.deallocate(a)
    assert [bm.blocks[i].ref_count for i in child.block_table] == [1, 1, 1]
    bm.check_invariants([child])


# ---------------------------------------------------------------------------------------------
# stateful property test
# ---------------------------------------------------------------------------------------------
NUM_BLOCKS, BLOCK_SIZE = 12, 3
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=14)   # small alphabet: many prefix hits


class BlockManagerMachine(RuleBasedStateMachine):

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.idle: list[Sequence] = []      # holds no blocks
        self.active: list[Sequence] = []    # holds blocks

    # -- helpers --
    def state(self):
        return snapshot(self.bm, self.idle + self.active)

    def check_refused(self, can, action):
        before = copy.deepcopy(self.state())
        try:
            result = action()
        except NoFreeBlocksError:
            assert not can, "can_* said yes but the action was refused"
            assert self.state() == before, "a refused action changed state"
            return None, False
        assert can, "can_* said no but the action succeeded"
        return result, True

    # -- rules --
    @rule(ids=tokens)
    def new_sequence(self, ids):
        self.idle.append(Sequence(ids))

    @precondition(lambda self: self.idle)
    @rule(i=st.integers(0, 99), lookahead=st.integers(0, 7))
    def allocate(self, i, lookahead):
        seq = self.idle[i % len(self.idle)]
        expected_hits = self.bm.num_prefix_cached_tokens(seq)
        can = self.bm.can_allocate(seq, lookahead)
        _, ok = self.check_refused(can, lambda: self.bm.allocate(seq, lookahead))
        if ok:
            self.idle.remove(seq)
            self.active.append(seq)
            assert len(seq.block_table) == -(-(seq.num_tokens + lookahead) // BLOCK_SIZE)
            assert seq.num_cached_tokens == expected_hits <= seq.num_tokens - 1

    @precondition(lambda self: self.active)
    @rule(i=st.integers(0, 99), n=st.integers(0, 7), data=st.data())
    def append(self, i, n, data):
        seq = self.active[i % len(self.active)]
        can = self.bm.can_append(seq, n)
        _, ok = self.check_refused(can, lambda: self.bm.may_append(seq, n))
        if ok:
            assert len(seq.block_table) >= -(-(seq.num_tokens + n) // BLOCK_SIZE)
            # the step commits m <= n new tokens (never more than were reserved)
            new = data.draw(st.lists(st.integers(0, 2), max_size=n))
            seq.append_tokens(new)

    @precondition(lambda self: self.active)
    @rule(i=st.integers(0, 99), c=st.integers(0, 8))
    def advance_and_commit(self, i, c):
        seq = self.active[i % len(self.active)]
        seq.num_computed_tokens = min(seq.num_computed_tokens + c, seq.num_tokens,
                                      len(seq.block_table) * BLOCK_SIZE)
        self.bm.commit(seq)

    @precondition(lambda self: self.active)
    @rule(i=st.integers(0, 99))
    def free(self, i):
        seq = self.active.pop(i % len(self.active))
        self.bm.deallocate(seq)
        assert not seq.block_table and seq.num_computed_tokens == 0
        self.idle.append(seq)            # may be allocated again (like a preempted request)

    @precondition(lambda self: self.active)
    @rule(i=st.integers(0, 99))
    def fork(self, i):
        seq = self.active[i % len(self.active)]
        can = self.bm.can_fork(seq)
        child, ok = self.check_refused(can, lambda: self.bm.fork(seq))
        if ok:
            self.active.append(child)

    @precondition(lambda self: self.idle or self.active)
    @rule(i=st.integers(0, 99))
    def bad_input_changes_nothing(self, i):
        before = copy.deepcopy(self.state())
        pool = self.idle + self.active
        seq = pool[i % len(pool)]
        with pytest.raises(ValueError):
            if seq.block_table:
                self.bm.allocate(seq)
            else:
                self.bm.may_append(seq, 1)
        with pytest.raises(ValueError):
            self.bm.can_append(seq, -1) if seq.block_table else self.bm.can_allocate(seq, -1)
        assert self.state() == before

    # -- invariants --
    @invariant()
    def no_leak_no_double_free_no_unreferenced_sharing(self):
        bm = self.bm
        bm.check_invariants(self.active)   # ref_count == number of holders, pools disjoint, sums
        assert bm.num_free_blocks + bm.num_used_blocks == NUM_BLOCKS
        assert all(not s.block_table for s in self.idle)
        holders = {}
        for s in self.active:
            assert s.num_computed_tokens <= min(s.num_tokens, len(s.block_table) * BLOCK_SIZE)
            for j, block_id in enumerate(s.block_table):
                holders.setdefault(block_id, []).append((s, j))
        for block_id, hs in holders.items():
            block = bm.blocks[block_id]
            # A shared or registered block is never written again: in every holder it lies
            # entirely below seq_len, and its registered tokens are the holder's tokens there.
            if len(hs) > 1 or block.hash is not None:
                for s, j in hs:
                    assert (j + 1) * BLOCK_SIZE <= s.num_computed_tokens, (block, s)
                    if block.hash is not None:
                        assert tuple(s.token_ids[j * BLOCK_SIZE:(j + 1) * BLOCK_SIZE]) == block.token_ids
                        assert s.block_hashes[j] == block.hash


TestBlockManagerStateful = BlockManagerMachine.TestCase
TestBlockManagerStateful.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
