"""ragged_paged_attention kernel == reference == dense oracle (interpret mode on CPU;
MTPJAX_KERNELS_ON_DEVICE=1 runs the compiled kernel on a GPU)."""
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import (ragged_paged_attention,
                                                   ragged_paged_attention_reference)
from tests.kernel_oracle import (TOL, dense_attention, interpret_mode, random_paged_cache,
                                    rel_err)


def _case(seed, q_lens, max_seqs, h, kvh, d, page, max_pages, pad_tokens=3):
  """A ragged batch: live sequences q_lens, then padding sequences and tokens."""
  rng = np.random.default_rng(seed)
  n = len(q_lens)
  kv_lens = np.zeros(max_seqs, np.int64)
  for s, ql in enumerate(q_lens):
    # KV length >= q_len mostly; sometimes shorter (negative positions -> zeros).
    lo = ql if rng.random() < 0.85 else 0
    kv_lens[s] = rng.integers(lo, max_pages * page + 1) if lo <= max_pages * page else lo
  kv_lens = np.minimum(kv_lens, max_pages * page)
  k, v, bt = random_paged_cache(rng, kv_lens, kvh, page, d, max_pages)
  cu = np.zeros(max_seqs + 1, np.int32)
  cu[1:n + 1] = np.cumsum(q_lens)
  cu[n + 1:] = cu[n]
  t = int(cu[n]) + pad_tokens
  q = rng.standard_normal((t, h, d)).astype(np.float32)
  return q, k, v, bt, kv_lens.astype(np.int32), cu, np.int32(n)


def _oracle(q, k, v, bt, kv_lens, cu, n, **kw):
  out = np.zeros(q.shape)
  for s in range(int(n)):
    a, b = cu[s], cu[s + 1]
    if b > a:
      out[a:b] = dense_attention(q[a:b], k, v, bt[s], int(kv_lens[s]), **kw)
  return out


CASES = [
    # dtype, page, d, H, KVH, q_lens, block_q, small_q, small splits, soft_cap
    ("float32", 8, 64, 4, 2, [5, 0, 1, 12, 3], 4, 4, 1, None),
    ("bfloat16", 16, 128, 8, 2, [1, 4, 4, 19, 0, 1], 8, 4, 1, None),
    ("bfloat16", 32, 64, 6, 2, [7, 1, 2], 2, 2, 2, 25.0),
    ("float32", 64, 128, 4, 4, [3, 0, 9], 16, 8, 1, None),
    ("float32", 16, 64, 8, 1, [0, 2, 33, 1], 16, 2, 3, None),
]


@pytest.mark.parametrize("dtype,page,d,h,kvh,q_lens,block_q,small_q,splits,soft_cap", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_matches_reference(seed, dtype, page, d, h, kvh, q_lens, block_q, small_q,
                                  splits, soft_cap):
  q, k, v, bt, kv_lens, cu, n = _case(seed, q_lens, len(q_lens) + 2, h, kvh, d, page,
                                      max_pages=5)
  dt = jnp.dtype(dtype)
  args = (jnp.asarray(q, dt), jnp.asarray(k, dt), jnp.asarray(v, dt), jnp.asarray(bt),
          jnp.asarray(kv_lens), jnp.asarray(cu), jnp.int32(n))
  out = ragged_paged_attention(*args, soft_cap=soft_cap, interpret=interpret_mode(),
                               block_q=block_q, small_q=small_q, small_num_splits=splits,
                               pages_per_block=2, small_pages_per_block=2)
  ref = ragged_paged_attention_reference(*args, soft_cap=soft_cap)
  assert out.dtype == dt and out.shape == q.shape
  assert rel_err(out, ref) < TOL[dtype]
  # Tokens past cu_q_lens[num_seqs] are zeros.
  assert not np.asarray(out[cu[n]:], np.float32).any()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_matches_dense_oracle(seed):
  q, k, v, bt, kv_lens, cu, n = _case(seed, [6, 0, 1, 4, 11], 7, 6, 2, 64, 8, max_pages=4)
  for kw in (dict(), dict(sm_scale=0.2, soft_cap=10.0)):
    ref = ragged_paged_attention_reference(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(bt), jnp.asarray(kv_lens),
        jnp.asarray(cu), jnp.asarray([n], jnp.int32), **kw)
    assert rel_err(ref, _oracle(q, k, v, bt, kv_lens, cu, n, **kw)) < 1e-5


def test_uniform_batch_equals_paged_attention():
  """A ragged batch of equal q_len segments is the paged_attention batch."""
  from pallas_kernels.paged_attention import paged_attention_reference
  q, k, v, bt, kv_lens, cu, n = _case(3, [3, 3, 3], 3, 4, 2, 64, 16, 4, pad_tokens=0)
  kv_lens = np.maximum(kv_lens, 3)
  a = ragged_paged_attention_reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                       jnp.asarray(bt), jnp.asarray(kv_lens),
                                       jnp.asarray(cu), jnp.int32(3))
  b = paged_attention_reference(jnp.asarray(q.reshape(3, 3, 4, 64)), jnp.asarray(k),
                                jnp.asarray(v), jnp.asarray(bt), jnp.asarray(kv_lens))
  np.testing.assert_allclose(np.asarray(a), np.asarray(b).reshape(9, 4, 64), atol=1e-6)


@pytest.mark.parametrize("q_lens,pad,small_q,splits,dead_len", [
    ([2, 1], 3, 8, 1, 0),    # t <= small_q: the small launch writes the tail itself
    ([2, 1], 3, 8, 2, 0),    # ... or, with KV splits, its zero-initialized partials
    ([9, 1], 4, 4, 1, 2),    # prefill launch writes the tail; dead sequences own tokens
    ([20], 37, 2, 1, 5),     # tail of several prefill tiles
    ([0, 0], 5, 8, 1, 0),    # no live tokens at all
])
def test_tail_tokens_are_zeros(q_lens, pad, small_q, splits, dead_len):
  """Every token past cu_q_lens[num_seqs] reads 0 (the output buffer is not
  zero-filled: interpret mode starts it as NaN), including tokens that dead
  sequences' cu_q_lens entries span."""
  n = len(q_lens)
  q, k, v, bt, kv_lens, cu, _ = _case(5, q_lens, n + 2, 4, 2, 64, 16, 4, pad_tokens=pad)
  cu[n + 1] = cu[n] + min(dead_len, pad)  # a dead sequence with tokens (ignored)
  cu[n + 2] = cu[n + 1]
  args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(bt),
          jnp.asarray(kv_lens), jnp.asarray(cu), jnp.int32(n))
  out = ragged_paged_attention(*args, interpret=interpret_mode(), block_q=4, small_q=small_q,
                               small_num_splits=splits)
  ref = ragged_paged_attention_reference(*args)
  assert not np.isnan(np.asarray(out)).any()
  assert rel_err(out, ref) < TOL["float32"] or not np.asarray(ref).any()
  assert not np.asarray(out[cu[n]:]).any()


def _good():
  kv = jnp.zeros((2, 6, 16, 64), jnp.float32)
  return dict(q=jnp.zeros((5, 4, 64), jnp.float32), k_pages=kv, v_pages=kv,
              block_tables=jnp.zeros((3, 2), jnp.int32), kv_lens=jnp.zeros((3,), jnp.int32),
              cu_q_lens=jnp.zeros((4,), jnp.int32), num_seqs=jnp.int32(1))


@pytest.mark.parametrize("change,match", [
    (dict(q=jnp.zeros((5, 1, 4, 64), jnp.float32)), "q must be 3-D"),
    (dict(q=jnp.zeros((5, 4, 64), jnp.float16)), "bfloat16 or float32"),
    (dict(q=jnp.zeros((5, 3, 64), jnp.float32)), "multiple of num_kv_heads"),
    (dict(k_pages=jnp.zeros((2, 6, 16, 128), jnp.float32)), "v_pages shape"),
    (dict(block_tables=jnp.zeros((3,), jnp.int32)), "block_tables must be 2-D"),
    (dict(kv_lens=jnp.zeros((4,), jnp.int32)), "kv_lens shape"),
    (dict(cu_q_lens=jnp.zeros((3,), jnp.int32)), "cu_q_lens shape"),
    (dict(cu_q_lens=jnp.zeros((4,), jnp.float32)), "cu_q_lens must be int32"),
    (dict(num_seqs=jnp.zeros((2,), jnp.int32)), "num_seqs must be a scalar"),
    (dict(num_seqs=jnp.float32(1)), "num_seqs must be int32"),
])
def test_wrapper_value_errors(change, match):
  a = {**_good(), **change}
  with pytest.raises(ValueError, match=match):
    ragged_paged_attention(*a.values(), interpret=True)


def test_bad_tuning():
  with pytest.raises(ValueError, match="block_q"):
    ragged_paged_attention(*_good().values(), interpret=True, block_q=0)
  with pytest.raises(ValueError, match="unknown tuning"):
    ragged_paged_attention(*_good().values(), interpret=True, foo=1)
