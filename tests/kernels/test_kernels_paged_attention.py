"""paged_attention kernel == reference == dense oracle (interpret mode on CPU;
MTPJAX_KERNELS_ON_DEVICE=1 runs the compiled kernel on a GPU)."""
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from tests.kernel_oracle import (TOL, dense_attention, interpret_mode, random_paged_cache,
                                    rel_err)


def _case(seed, b, q_len, h, kvh, d, page, max_pages):
  rng = np.random.default_rng(seed)
  kv_lens = rng.integers(0, max_pages * page + 1, size=b)
  kv_lens[0] = 0  # padding row
  if b > 1:
    kv_lens[1] = max(q_len - 1, 0)  # some query positions < 0
  if b > 2:
    kv_lens[2] = page * 2 + page // 2  # ends mid-page
  if b > 3:
    kv_lens[3] = max_pages * page  # full table
  k, v, bt = random_paged_cache(rng, kv_lens, kvh, page, d, max_pages)
  q = rng.standard_normal((b, q_len, h, d)).astype(np.float32)
  return q, k, v, bt, kv_lens.astype(np.int32)


def _oracle(q, k, v, bt, kv_lens, **kw):
  return np.stack([dense_attention(q[i], k, v, bt[i], int(kv_lens[i]), **kw)
                   for i in range(q.shape[0])])


CASES = [
    # dtype, page, d, Q, H, KVH, splits, soft_cap, pages_per_block
    ("float32", 8, 64, 1, 4, 4, 1, None, 2),
    ("bfloat16", 16, 128, 4, 8, 2, 1, None, 2),
    ("bfloat16", 32, 64, 8, 8, 1, 2, 30.0, 1),
    ("float32", 64, 128, 2, 6, 2, 1, None, 1),
    ("float32", 16, 64, 3, 4, 2, 4, 5.0, 1),
    ("bfloat16", 8, 128, 1, 16, 2, 2, None, 4),
]


@pytest.mark.parametrize("dtype,page,d,q_len,h,kvh,splits,soft_cap,ppb", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_matches_reference(seed, dtype, page, d, q_len, h, kvh, splits, soft_cap, ppb):
  q, k, v, bt, kv_lens = _case(seed, 5, q_len, h, kvh, d, page, max_pages=5)
  dt = jnp.dtype(dtype)
  args = (jnp.asarray(q, dt), jnp.asarray(k, dt), jnp.asarray(v, dt), jnp.asarray(bt),
          jnp.asarray(kv_lens))
  out = paged_attention(*args, soft_cap=soft_cap, interpret=interpret_mode(),
                        num_splits=splits, pages_per_block=ppb)
  ref = paged_attention_reference(*args, soft_cap=soft_cap)
  assert out.dtype == dt and out.shape == q.shape
  assert rel_err(out, ref) < TOL[dtype]
  # Padding row (kv_len 0) and rows at negative positions are exactly zero.
  assert not np.asarray(out[0], np.float32).any()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("q_len,h,kvh,page,soft_cap,scale", [(1, 4, 2, 8, None, None),
                                                            (4, 6, 3, 16, 20.0, 0.3)])
def test_reference_matches_dense_oracle(seed, q_len, h, kvh, page, soft_cap, scale):
  q, k, v, bt, kv_lens = _case(seed, 4, q_len, h, kvh, 64, page, max_pages=4)
  ref = paged_attention_reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                  jnp.asarray(bt), jnp.asarray(kv_lens), sm_scale=scale,
                                  soft_cap=soft_cap)
  want = _oracle(q, k, v, bt, kv_lens, sm_scale=scale, soft_cap=soft_cap)
  assert rel_err(ref, want) < 1e-5


def _good():
  q = jnp.zeros((2, 1, 4, 64), jnp.float32)
  kv = jnp.zeros((2, 6, 16, 64), jnp.float32)
  return dict(q=q, k_pages=kv, v_pages=kv, block_tables=jnp.zeros((2, 3), jnp.int32),
              kv_lens=jnp.zeros((2,), jnp.int32))


@pytest.mark.parametrize("change,match", [
    (dict(q=jnp.zeros((2, 4, 64), jnp.float32)), "q must be 4-D"),
    (dict(q=jnp.zeros((2, 9, 4, 64), jnp.float32)), "q_len"),
    (dict(q=jnp.zeros((2, 1, 3, 64), jnp.float32)), "multiple of num_kv_heads"),
    (dict(q=jnp.zeros((2, 1, 4, 64), jnp.float16)), "bfloat16 or float32"),
    (dict(k_pages=jnp.zeros((2, 6, 16, 64), jnp.bfloat16)), "dtype"),
    (dict(v_pages=jnp.zeros((2, 5, 16, 64), jnp.float32)), "v_pages shape"),
    (dict(q=jnp.zeros((2, 1, 4, 32), jnp.float32)), "head_dim must be one of"),
    (dict(k_pages=jnp.zeros((2, 6, 12, 64), jnp.float32),
          v_pages=jnp.zeros((2, 6, 12, 64), jnp.float32)), "page_size"),
    (dict(block_tables=jnp.zeros((3, 3), jnp.int32)), "block_tables batch"),
    (dict(block_tables=jnp.zeros((2, 3), jnp.float32)), "block_tables must be int32"),
    (dict(kv_lens=jnp.zeros((3,), jnp.int32)), "kv_lens shape"),
    (dict(kv_lens=jnp.zeros((2,), jnp.float32)), "kv_lens must be int32"),
])
def test_wrapper_value_errors(change, match):
  a = {**_good(), **change}
  with pytest.raises(ValueError, match=match):
    paged_attention(a["q"], a["k_pages"], a["v_pages"], a["block_tables"], a["kv_lens"],
                    interpret=True)


def test_bad_options():
  a = _good()
  with pytest.raises(ValueError, match="soft_cap"):
    paged_attention(*a.values(), soft_cap=-1.0, interpret=True)
  with pytest.raises(ValueError, match="unknown tuning"):
    paged_attention(*a.values(), interpret=True, block_k=3)


@pytest.mark.parametrize("q_len,h", [(1, 8), (4, 16)])
def test_direct_items_equals_item_search(q_len, h):
  """The uniform fast path (no item search, no output memset) == the ragged item path."""
  q, k, v, bt, kv_lens = _case(3, 4, q_len, h, 2, 64, 16, max_pages=4)
  args = (jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16),
          jnp.asarray(v, jnp.bfloat16), jnp.asarray(bt), jnp.asarray(kv_lens))
  a = paged_attention(*args, interpret=interpret_mode())
  b = paged_attention(*args, interpret=interpret_mode(), direct_items=False)
  np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
