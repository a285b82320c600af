"""draft_roll kernel == reference == per-segment numpy concat (interpret mode on CPU;
MTPJAX_KERNELS_ON_DEVICE=1 runs the compiled kernel on a GPU)."""
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.draft_roll import draft_roll, draft_roll_reference
from tests.kernel_oracle import interpret_mode


def _case(seed, lens, n_max, hd, tail, dtype):
  rng = np.random.default_rng(seed)
  s = len(lens)
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  t = int(cu[-1]) + tail
  tok = rng.integers(0, 1000, t).astype(np.int32)
  pos = rng.integers(0, 1000, t).astype(np.int32)
  hid = rng.standard_normal((t, hd)).astype(dtype)
  nt = rng.integers(1000, 2000, (s, n_max)).astype(np.int32)
  npos = rng.integers(1000, 2000, (s, n_max)).astype(np.int32)
  nh = rng.standard_normal((s, n_max, hd)).astype(dtype)
  nn = rng.integers(0, n_max + 1, s).astype(np.int32)
  return tok, pos, hid, cu, nt, npos, nh, nn


def _oracle(tok, pos, hid, cu, nt, npos, nh, nn):
  out = [tok.copy(), pos.copy(), hid.copy()]
  for s in range(len(cu) - 1):
    a, b = cu[s], cu[s + 1]
    if b == a:
      continue
    for o, old, new in zip(out, (tok, pos, hid), (nt, npos, nh)):
      o[a:b] = np.concatenate([old[a:b], new[s, :nn[s]]])[-(b - a):]
  return out


CASES = [
    # lens, N, Hd, tail, dtype, block_t, block_h
    ([3, 0, 5, 1, 4], 3, 40, 2, np.float32, 4, 16),
    ([1, 1, 1, 1], 4, 64, 0, np.float32, 8, 64),  # num_new > L: only the last new remain
    ([9, 2, 0, 0, 6, 3, 1], 2, 100, 5, jnp.bfloat16, 8, 32),
    ([16, 7], 8, 128, 1, jnp.bfloat16, 16, 128),
]


@pytest.mark.parametrize("lens,n_max,hd,tail,dtype,block_t,block_h", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_and_reference_match_oracle(seed, lens, n_max, hd, tail, dtype, block_t,
                                           block_h):
  arrs = _case(seed, lens, n_max, hd, tail, dtype)
  want = _oracle(*arrs)
  args = [jnp.asarray(a) for a in arrs]
  ref = draft_roll_reference(*args)
  out = draft_roll(*args, interpret=interpret_mode(), block_t=block_t, block_h=block_h)
  for o, r, w in zip(out, ref, want):
    np.testing.assert_array_equal(np.asarray(r), w)
    np.testing.assert_array_equal(np.asarray(o), w)
    assert o.dtype == w.dtype


def _good():
  return dict(tokens=jnp.zeros((6,), jnp.int32), positions=jnp.zeros((6,), jnp.int32),
              hidden=jnp.zeros((6, 8), jnp.float32), cu_seq_lens=jnp.zeros((3,), jnp.int32),
              new_tokens=jnp.zeros((2, 4), jnp.int32),
              new_positions=jnp.zeros((2, 4), jnp.int32),
              new_hidden=jnp.zeros((2, 4, 8), jnp.float32), num_new=jnp.zeros((2,), jnp.int32))


@pytest.mark.parametrize("change,match", [
    (dict(tokens=jnp.zeros((6, 1), jnp.int32)), "tokens must be 1-D"),
    (dict(tokens=jnp.zeros((6,), jnp.float32)), "tokens must be int32"),
    (dict(positions=jnp.zeros((5,), jnp.int32)), "positions shape"),
    (dict(hidden=jnp.zeros((5, 8), jnp.float32)), "hidden rows"),
    (dict(cu_seq_lens=jnp.zeros((1,), jnp.int32)), "at least 2"),
    (dict(new_tokens=jnp.zeros((3, 4), jnp.int32)), "new_tokens rows"),
    (dict(new_positions=jnp.zeros((2, 3), jnp.int32)), "new_positions shape"),
    (dict(new_hidden=jnp.zeros((2, 4, 9), jnp.float32)), "new_hidden shape"),
    (dict(new_hidden=jnp.zeros((2, 4, 8), jnp.bfloat16)), "new_hidden dtype"),
    (dict(num_new=jnp.zeros((3,), jnp.int32)), "num_new shape"),
])
def test_wrapper_value_errors(change, match):
  a = {**_good(), **change}
  with pytest.raises(ValueError, match=match):
    draft_roll(*a.values(), interpret=True)


@pytest.mark.parametrize("lens,n_max,hd,tail,block_t,block_h,h_loop", [
    ([3, 0, 5, 1, 4], 3, 40, 2, 4, 16, 2),   # last column block fully past Hd
    ([16, 8], 8, 128, 0, 8, 32, 4),          # unmasked fast path (block_t | T, 4*32 | Hd)
    ([9, 2, 0, 0, 6, 3, 1], 2, 100, 5, 8, 32, 3),
])
def test_kernel_h_loop_matches_oracle(lens, n_max, hd, tail, block_t, block_h, h_loop):
  arrs = _case(2, lens, n_max, hd, tail, np.float32)
  want = _oracle(*arrs)
  out = draft_roll(*[jnp.asarray(a) for a in arrs], interpret=interpret_mode(),
                   block_t=block_t, block_h=block_h, h_loop=h_loop)
  for o, w in zip(out, want):
    np.testing.assert_array_equal(np.asarray(o), w)
