"""mla_paged_attention kernel == reference == float64 oracle (interpret mode on CPU;
MTPJAX_KERNELS_ON_DEVICE=1 runs the compiled kernel on a GPU), and its ValueErrors."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla_paged_attention import mla_paged_attention, mla_paged_attention_reference
from tests.kernel_oracle import TOL, draw_seeds, interpret_mode, rel_err


def _case(seed, q_lens, kv_lens, h, rank, rope, page, max_pages, pad_seqs=1, pad_tokens=3):
  """Latent pages [P, S, R + dr] NaN except the live sequences' first kv_len slots; block
  tables randomly permuted, entries past each sequence's pages point at NaN pages."""
  rng = np.random.default_rng(seed)
  n = len(q_lens)
  s = n + pad_seqs
  width = rank + rope
  num_pages = s * max_pages + 3
  perm = rng.permutation(num_pages)
  bt = perm[: s * max_pages].reshape(s, max_pages).astype(np.int32)
  spare = perm[s * max_pages:]
  lat = np.full((num_pages, page, width), np.nan, np.float32)
  kv = np.zeros(s, np.int32)
  kv[:n] = kv_lens
  for i in range(n):
    for pos in range(kv[i]):
      lat[bt[i, pos // page], pos % page] = rng.standard_normal(width)
    for j in range(-(-int(kv[i]) // page), max_pages):
      bt[i, j] = spare[rng.integers(len(spare))]
  cu = np.zeros(s + 1, np.int32)
  cu[1:n + 1] = np.cumsum(q_lens)
  cu[n + 1:] = cu[n]
  q = rng.standard_normal((int(cu[n]) + pad_tokens, h, width)).astype(np.float32)
  return q, lat, bt, kv, cu, np.int32(n)


def _oracle(q, lat, bt, kv, cu, n, rank, scale):
  """float64, one token at a time, from each sequence's gathered latent."""
  out = np.zeros((q.shape[0], q.shape[1], rank))
  page = lat.shape[1]
  for s in range(int(n)):
    ql = cu[s + 1] - cu[s]
    pos = np.arange(kv[s])
    c = np.asarray(lat, np.float64)[bt[s, pos // page], pos % page]      # [kv, W]
    for j in range(ql):
      p = kv[s] - ql + j
      if p < 0:
        continue
      logits = np.asarray(q[cu[s] + j], np.float64) @ c[: p + 1].T * scale  # [H, p + 1]
      w = np.exp(logits - logits.max(axis=1, keepdims=True))
      out[cu[s] + j] = (w / w.sum(axis=1, keepdims=True)) @ c[: p + 1, :rank]
  return out


def _args(case, dtype):
  q, lat, bt, kv, cu, n = case
  dt = jnp.dtype(dtype)
  return (jnp.asarray(q, dt), jnp.asarray(lat, dt), jnp.asarray(bt), jnp.asarray(kv),
          jnp.asarray(cu), jnp.int32(n))


# Rows: decode (1), verify (4 = K+1, causal inside the row), an empty row (0), a prefill chunk
# (13), a row whose KV is shorter than its queries (negative positions -> zeros), ends in the
# middle of a page and on a page boundary.
CASES = [
    # dtype, H, page, q_lens, kv_lens, tuning
    ("float32", 4, 8, [1, 4, 0, 13, 3], [9, 16, 5, 30, 2], dict(block_q=4, block_k=16)),
    ("bfloat16", 8, 16, [4, 1, 4, 7], [33, 64, 4, 40],
     dict(block_q=2, block_h=4, block_k=16, num_splits=3)),
    ("bfloat16", 2, 4, [1, 1, 5, 1], [1, 17, 11, 0], dict(num_splits=2)),
    # opt-in register savers: output columns split over programs, QK in latent chunks
    ("float32", 4, 8, [1, 4, 0, 13, 3], [9, 16, 5, 30, 2],
     dict(block_q=4, block_k=16, value_split=2, qk_chunk=16)),
    ("bfloat16", 8, 16, [4, 1, 4, 7], [33, 64, 4, 40],
     dict(block_q=2, block_h=4, block_k=16, num_splits=3, value_split=2)),
    ("float32", 2, 4, [1, 1, 5, 1], [1, 17, 11, 0], dict(num_splits=2, qk_chunk=16)),
    # the logits' order given: the first three cases take the default (keys first for the
    # second; query first for the others, 16-row tiles whose KV blocks span pages), these
    # the other order on the same shapes
    ("float32", 4, 8, [1, 4, 0, 13, 3], [9, 16, 5, 30, 2],
     dict(block_q=4, block_k=16, keys_first=True)),
    ("bfloat16", 8, 16, [4, 1, 4, 7], [33, 64, 4, 40],
     dict(block_q=2, block_h=4, block_k=16, num_splits=3, keys_first=False)),
]


@pytest.mark.parametrize("dtype,h,page,q_lens,kv_lens,tuning", CASES)
def test_kernel_matches_reference(dtype, h, page, q_lens, kv_lens, tuning):
  rank, rope = 32, 16
  for seed in (0, 1, 2):          # same shapes: one compile, three random draws
    case = _case(seed, q_lens, kv_lens, h, rank, rope, page, max_pages=-(-40 // page) + 1)
    args = _args(case, dtype)
    out = mla_paged_attention(*args, kv_lora_rank=rank, sm_scale=0.2,
                              interpret=interpret_mode(), **tuning)
    ref = mla_paged_attention_reference(*args, kv_lora_rank=rank, sm_scale=0.2, token_chunk=8)
    assert out.dtype == jnp.dtype(dtype) and out.shape == (args[0].shape[0], h, rank)
    assert rel_err(out, ref) < TOL[dtype], seed
    # Tokens past cu_q_lens[num_seqs] read exactly zero.
    cu, n = case[4], case[5]
    assert not np.asarray(out[cu[n]:], np.float32).any(), seed


# The Mosaic-GPU kernel (kernel="mosaic": bf16, kv_lora_rank % 128, 64-token KV blocks):
# ragged rows with the same corner cases as above, a page smaller than, equal to and larger
# than the KV block, KV splits, and a 16-head decode batch whose tiles are 3/4 padding.
MOSAIC_CASES = [
    # H, page, q_lens, kv_lens, max_pages, tuning
    # (interpreted, each program runs its warpgroups through host callbacks on the CPU: few
    # rows, every corner kept)
    (8, 16, [1, 4, 0, 9], [9, 70, 5, 100], 7, dict(block_q=4, num_splits=2)),
    (16, 64, [1, 1, 1], [64, 1, 150], 3, dict(share_logits=False)),
    # compact tiles: 16 live rows in HBM (not 64), rows seeing no key zeroed by the kernel
    # (3 splits of at most 2 blocks: the last split of each row is empty)
    (4, 8, [4, 1], [67, 20], 9, dict(block_q=4, num_splits=3, compact=True)),
    # FlashMLA's seesaw (kernel_seesaw.py): 5 blocks (pairs in the loop, the last full pair
    # masked, a lone last block); then 3 splits (a lone block, a pair, an empty split) over
    # compact tiles
    (4, 16, [1, 4, 3], [300, 70, 150], 19, dict(block_q=4, seesaw=True)),
    (4, 64, [4, 1], [129, 200], 4, dict(block_q=4, num_splits=3, compact=True, seesaw=True)),
]


@pytest.mark.parametrize("index", range(len(MOSAIC_CASES)))
def test_mosaic_kernel_matches_reference(index):
  h, page, q_lens, kv_lens, max_pages, tuning = MOSAIC_CASES[index]
  rank, rope = 128, 64
  for seed in draw_seeds(index):
    # one padding token (not 3): each padding token can add an item to the static bound, and
    # each item is a program per split (~0.5 s interpreted); every case keeps an empty item
    case = _case(seed, q_lens, kv_lens, h, rank, rope, page, max_pages=max_pages,
                 pad_tokens=1)
    args = _args(case, "bfloat16")
    out = mla_paged_attention(*args, kv_lora_rank=rank, sm_scale=0.1,
                              interpret=interpret_mode(), kernel="mosaic", **tuning)
    ref = mla_paged_attention_reference(*args, kv_lora_rank=rank, sm_scale=0.1, token_chunk=8)
    assert out.dtype == jnp.bfloat16 and out.shape == (args[0].shape[0], h, rank)
    assert rel_err(out, ref) < TOL["bfloat16"], seed
    cu, n = case[4], case[5]
    assert not np.asarray(out[cu[n]:], np.float32).any(), seed


def test_mosaic_lazy_max_with_jumping_logits():
  """The Mosaic kernel's running max lags (it moves only when a block's max exceeds it by
  more than LAZY_MAX, and a thread skips the accumulator's rescale when its rows did not
  move). A loud rope column rising along each sequence makes the block maxima of half the
  heads jump by far more than that, so the rescale runs on some threads and not on others;
  the output must still be the reference's."""
  from pallas_kernels.mla_paged_attention.kernel_mgpu import LAZY_MAX
  rank, rope, h, page, scale = 128, 64, 4, 16, 0.1
  q_lens, kv_lens = [1, 4], [150, 260]
  for seed in draw_seeds(8):
    q, lat, bt, kv, cu, n = _case(seed, q_lens, kv_lens, h, rank, rope, page, max_pages=17)
    rng = np.random.default_rng(seed)
    for s in range(int(n)):     # a loud rope column rising along the sequence, with noise
      pos = np.arange(kv[s])
      lat[bt[s, pos // page], pos % page, -1] = 10 * pos / kv[s] + rng.uniform(0, 2, kv[s])
    q[:, : h // 2, -1] = 300.0  # heads 0-1 jump; 2-3 keep their max (their threads skip)
    # The case does what it claims: some row's 64-key block max jumps past the running max.
    pos = np.arange(kv[1])
    keys = lat[bt[1, pos // page], pos % page]
    logits = (np.asarray(q[cu[1]], np.float64) @ keys.T) * scale * math.log2(math.e)
    block_max = np.maximum.accumulate(
        np.stack([logits[:, b:b + 64].max(axis=1) for b in range(0, kv[1], 64)], 1), axis=1)
    assert (np.diff(block_max, axis=1) > LAZY_MAX).any()
    args = _args((q, lat, bt, kv, cu, n), "bfloat16")
    out = mla_paged_attention(*args, kv_lora_rank=rank, sm_scale=scale,
                              interpret=interpret_mode(), kernel="mosaic", block_q=4)
    ref = mla_paged_attention_reference(*args, kv_lora_rank=rank, sm_scale=scale, token_chunk=8)
    assert np.isfinite(np.asarray(out[:cu[n]], np.float32)).all(), seed
    assert rel_err(out, ref) < TOL["bfloat16"], seed


def test_mosaic_masks_the_blocks_a_verify_row_straddles():
  """A q_len-4 row at positions 62-65 straddles KV blocks 0 and 1: both need the causal mask,
  though block 0 is not the last (the kernel masks only a suffix of the blocks). The keys
  at positions 63-65 are made loud (large logits for every query), so a token that saw one
  it must not would take its output from it."""
  rank, rope, h, page = 128, 64, 4, 16
  for seed in draw_seeds(7):
    q, lat, bt, kv, cu, n = _case(seed, [4], [66], h, rank, rope, page, max_pages=5,
                                  pad_seqs=0, pad_tokens=0)
    loud = q.sum(axis=(0, 1))
    for pos in (63, 64, 65):
      lat[bt[0, pos // page], pos % page] = 40 * loud / np.linalg.norm(loud)
    args = _args((q, lat, bt, kv, cu, n), "bfloat16")
    out = mla_paged_attention(*args, kv_lora_rank=rank, sm_scale=0.1, kernel="mosaic",
                              interpret=interpret_mode(), block_q=4)
    ref = mla_paged_attention_reference(*args, kv_lora_rank=rank, sm_scale=0.1, token_chunk=8)
    for j in range(4):              # each token on its own: the loud keys dominate the rest
      assert rel_err(out[j], ref[j]) < TOL["bfloat16"], (seed, j)


@pytest.mark.parametrize("h,q_len,kv_lens,splits,pad_seqs", [
    (16, 1, [70, 1, 130], 2, 0),        # decode: 16-row tiles, reshaped from q
    (4, 4, [67, 2, 128], 1, 0),         # verify: 4 tokens x 4 heads; one row's KV < q_len
    (32, 4, [67, 2, 130], 1, 0),        # token-major: 2 head groups of 16, read in place
    (32, 4, [67, 2, 130], 2, 1),        # ... with 2 KV splits merged, and a padding slot
])
def test_mosaic_uniform_batch_runs_without_gathers(h, q_len, kv_lens, splits, pad_seqs):
  """compact + uniform_q_len (what the model's dispatch passes for decode / verify steps):
  no gathers (token-major in place where a tile's heads are a multiple of 8, else tiles by
  reshape), and the result is the reference's; a padding slot's rows (past num_seqs, its
  block table into NaN pages) come out exactly 0."""
  rank, rope, page = 128, 64, 16
  live = q_len * len(kv_lens)
  for seed in draw_seeds(5 + q_len):      # draws apart from the cases' above (0-2)
    case = _case(seed, [q_len] * len(kv_lens), kv_lens, h, rank, rope, page, max_pages=9,
                 pad_seqs=pad_seqs, pad_tokens=pad_seqs * q_len)
    args = _args(case, "bfloat16")
    ref = mla_paged_attention_reference(*args, kv_lora_rank=rank, sm_scale=0.1, token_chunk=8)
    # verify with one split: through both Mosaic kernels
    for seesaw in (False, True) if q_len > 1 and splits == 1 else (None,):
      out = mla_paged_attention(*args, kv_lora_rank=rank, sm_scale=0.1, kernel="mosaic",
                                interpret=interpret_mode(), uniform_q_len=q_len,
                                block_q=q_len, compact=True, num_splits=splits,
                                seesaw=seesaw)
      assert rel_err(out[:live], ref[:live]) < TOL["bfloat16"], (seed, seesaw)
      assert not np.any(np.asarray(out[live:], np.float32)), (seed, seesaw)


@pytest.mark.parametrize("heads,q_len,uniform,ctx,page,expected", [
    (128, 4, True, 4096, 64, True),       # H=128 verify: 512 tiles, one split
    (128, 4, True, 4096, 16, False),      # ... at page 16 (four copies a half block)
    (128, 1, True, 4096, 64, False),      # H=128 decode
    (16, 4, True, 4096, 64, False),       # H=16 verify: 2 splits
    (16, 4, True, 256, 64, False),        # ... one split, but bytes-bound (64 rows a request)
    (128, 4, False, 4096, 64, False),     # a ragged batch (prefill chunks and verify rows)
])
def test_mosaic_default_takes_the_seesaw_where_it_measured_faster(monkeypatch, heads, q_len,
                                                                  uniform, ctx, page,
                                                                  expected):
  """kernel="mosaic" with no seesaw option: FlashMLA's schedule for compute-bound uniform
  verify steps without KV splits, on 64-token pages (B=64, ctx 4096: the H100 measured it
  faster at H=128, page 64, and slower at page 16)."""
  from pallas_kernels.mla_paged_attention import mosaic_tiles
  called = []

  def recorder(name, fn):
    def wrapped(*a, **kw):
      called.append(name)
      return fn(*a, **kw)
    return wrapped

  monkeypatch.setattr(mosaic_tiles, "mla_tiles_seesaw",
                      recorder("seesaw", mosaic_tiles.mla_tiles_seesaw))
  monkeypatch.setattr(mosaic_tiles, "mla_tiles_mgpu",
                      recorder("split", mosaic_tiles.mla_tiles_mgpu))
  b = 64
  S = jax.ShapeDtypeStruct
  jax.eval_shape(
      lambda *a: mla_paged_attention(*a, kv_lora_rank=512, kernel="mosaic", block_q=q_len,
                                     uniform_q_len=q_len if uniform else None),
      S((b * q_len, heads, 576), jnp.bfloat16),
      S((b * ctx // page + 8, page, 576), jnp.bfloat16),
      S((b, ctx // page), jnp.int32), S((b,), jnp.int32), S((b + 1,), jnp.int32),
      S((), jnp.int32))
  assert called == ["seesaw" if expected else "split"], called


def _sub_jaxprs(jaxpr):
  """jaxpr and every jaxpr nested in its equations' parameters (bodies, branches), in order."""
  yield jaxpr
  for eqn in jaxpr.eqns:
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _sub_jaxprs(sub)


def test_mosaic_schedule_keeps_its_measured_orderings():
  """Guards on the traced Mosaic kernel (no GPU) for orderings that a refactor could lose
  silently and that the H100 measured faster (docs/kernels.md): the memory
  warpgroup reads a block's table entries before waiting for its slot; wg 0 issues its
  P . V wgmma before the P / alpha stores and the p_ready arrive; no automatic store
  barriers."""
  from pallas_kernels.mla_paged_attention.kernel_mgpu import mla_tiles_mgpu
  q = jnp.zeros((4, 64, 576), jnp.bfloat16)
  lat = jnp.zeros((8, 16, 576), jnp.bfloat16)          # page 16: four copies a block
  bt = jnp.zeros((2, 16), jnp.int32)
  tiles = jnp.zeros((4,), jnp.int32)
  traced = jax.make_jaxpr(lambda *a: mla_tiles_mgpu(*a, rank=512, block_h=64, sm_scale=0.1))(
      q, lat, bt, tiles, tiles, tiles)
  jaxprs = list(_sub_jaxprs(traced.jaxpr))

  loads_first = []
  for j in jaxprs:
    prims = [e.primitive.name for e in j.eqns]
    if prims.count("copy_gmem_to_smem") != 4:
      continue
    slot_wait = [i for i, e in enumerate(j.eqns) if e.primitive.name == "cond" and any(
        "barrier_wait" in [x.primitive.name for x in b.eqns]
        for b in jax.extend.core.jaxprs_in_params(e.params))]
    gets = [i for i, p in enumerate(prims) if p == "get"]
    if slot_wait and gets:
      loads_first.append(max(gets) < slot_wait[0] < prims.index("copy_gmem_to_smem"))
  assert loads_first == [True], loads_first

  handed_after_issue = []
  for j in jaxprs:
    prims = [e.primitive.name for e in j.eqns]
    if "wgmma_ref" in prims and "swap" in prims:
      handed_after_issue.append(prims.index("wgmma_ref") < prims.index("swap")
                                < prims.index("barrier_arrive"))
  assert handed_after_issue and all(handed_after_issue), handed_after_issue

  params = [e.params["compiler_params"] for j in jaxprs for e in j.eqns
            if "compiler_params" in e.params]
  assert params and all(getattr(p, "unsafe_no_auto_barriers", False) for p in params)


def test_seesaw_schedule_keeps_its_measured_orderings():
  """Guards on the traced seesaw kernel (no GPU) for the orderings the H100 measured faster
  (docs/kernels.md): wg 0 publishes its block maximum before its
  exponentials; wg 1 publishes its maximum and hands P1 over before it waits for P0 (and
  multiplies P0 . V0_R)."""
  from pallas_kernels.mla_paged_attention.kernel_seesaw import mla_tiles_seesaw
  q = jnp.zeros((4, 64, 576), jnp.bfloat16)
  lat = jnp.zeros((8, 64, 576), jnp.bfloat16)
  bt = jnp.zeros((2, 16), jnp.int32)
  tiles = jnp.zeros((4,), jnp.int32)
  traced = jax.make_jaxpr(
      lambda *a: mla_tiles_seesaw(*a, rank=512, block_h=16, sm_scale=0.1))(
          q, lat, bt, tiles, tiles, tiles)
  wg0, wg1 = [], []
  for j in _sub_jaxprs(traced.jaxpr):
    prims = [e.primitive.name for e in j.eqns]
    if prims.count("barrier_arrive") < 2 or "inline_mgpu_p" not in prims:
      continue          # not a pair's body
    syncs = [p for p in prims if p in ("barrier_arrive", "barrier_wait")]
    if syncs[0] == "barrier_arrive":      # wg 0: m0 before any exponential
      exps = [i for i, p in enumerate(prims) if p in ("exp2", "inline_mgpu_p")]
      wg0.append(prims.index("barrier_arrive") < exps[0])
    else:                                 # wg 1: wait m0, publish m1 and P1, wait P0
      wg1.append(syncs[:4] == ["barrier_wait", "barrier_arrive", "barrier_arrive",
                               "barrier_wait"])
  assert len(wg0) == 3 and all(wg0), wg0      # unmasked, masked and lone-block pairs
  # unmasked and masked pairs; a lone last block's pair hands over no P1
  assert sorted(wg1) == [False, True, True], wg1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_emulated_exp2_is_within_its_cubic_error(seed):
  """The Mosaic kernel's exp2 on the FMA units (`exp2_poly`, which its PTX mirrors): relative
  error below 1e-4 over the softmax's range (P <= 2^LAZY_MAX), exact at integers, at most
  2^-126 (no NaN, no wrap) below -126."""
  from pallas_kernels.mla_paged_attention.kernel_mgpu import LAZY_MAX, exp2_poly
  rng = np.random.default_rng(seed)
  x = rng.uniform(-126.0, LAZY_MAX, 50_000).astype(np.float32)
  got = np.asarray(exp2_poly(jnp.asarray(x)), np.float64)
  assert np.max(np.abs(got / np.exp2(x.astype(np.float64)) - 1)) < 1e-4
  ints = rng.integers(-126, int(LAZY_MAX) + 1, 200).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(exp2_poly(jnp.asarray(ints))), np.exp2(ints))
  low = np.concatenate([rng.uniform(-1e30, -126.0, 1000), [-np.inf]]).astype(np.float32)
  tiny = np.asarray(exp2_poly(jnp.asarray(low)))
  assert np.all((tiny >= 0) & (tiny <= 2.0 ** -126))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_matches_float64_oracle(seed):
  rank, rope, h, page = 16, 8, 3, 8
  case = _case(seed, [1, 5, 0, 9], [12, 5, 3, 26], h, rank, rope, page, max_pages=4)
  scale = 1 / math.sqrt(rank + rope)
  ref = mla_paged_attention_reference(*_args(case, "float32"), kv_lora_rank=rank, sm_scale=scale)
  assert rel_err(ref, _oracle(*case, rank, scale)) < 1e-5


def test_verify_rows_fold_into_heads_and_equal_one_token_calls():
  """A q_len-4 row in one tile (block_q 4) == the same 4 queries sent as 4 decode rows whose
  KV lengths end at each query's position (what causality inside the row means)."""
  rank, rope, h, page = 16, 8, 2, 8
  q, lat, bt, kv, cu, n = _case(3, [4], [21], h, rank, rope, page, max_pages=4, pad_seqs=0,
                                pad_tokens=0)
  args = _args((q, lat, bt, kv, cu, n), "float32")
  verify = mla_paged_attention(*args, kv_lora_rank=rank, interpret=True, block_q=4)
  singles = mla_paged_attention(
      args[0], args[1], jnp.asarray(np.repeat(bt, 4, axis=0)),
      jnp.asarray([18, 19, 20, 21], jnp.int32), jnp.arange(5, dtype=jnp.int32), jnp.int32(4),
      kv_lora_rank=rank, interpret=True)
  np.testing.assert_allclose(np.asarray(verify), np.asarray(singles), rtol=1e-5, atol=1e-6)


def test_value_errors_name_the_bad_value():
  q = jnp.zeros((4, 2, 48), jnp.float32)
  lat = jnp.zeros((6, 8, 48), jnp.float32)
  bt = jnp.zeros((2, 3), jnp.int32)
  kv = jnp.zeros((2,), jnp.int32)
  cu = jnp.zeros((3,), jnp.int32)
  ok = (q, lat, bt, kv, cu, jnp.int32(2))

  def err(match, *args, **kw):
    kw = {"kv_lora_rank": 32, "interpret": True, **kw}
    with pytest.raises(ValueError, match=match):
      mla_paged_attention(*args, **kw)

  err("q must be 3-D", q[0], *ok[1:])
  err("latent_pages width 40 must equal q width 48", q, lat[..., :40], *ok[2:])
  err("latent_pages dtype bfloat16 must equal q dtype float32", q, lat.astype(jnp.bfloat16),
      *ok[2:])
  err("kv_lora_rank must be a power of 2 >= 16, got 24", *ok, kv_lora_rank=24)
  err("value_split must be a power of 2 leaving >= 16 of kv_lora_rank=32 columns per "
      "program, got 4", *ok, value_split=4)
  err("value_split must be a power of 2.*got 3", *ok, value_split=3)
  err("qk_chunk must be None or a power of 2 in 16..kv_lora_rank=32, got 64", *ok, qk_chunk=64)
  err("rope_dim = width 40 - kv_lora_rank 32 = 8 must be a power of 2 >= 16",
      q[..., :40], lat[..., :40], *ok[2:], interpret=False)
  err("page_size must be a power of 2 in 4..256, got 6", q, jnp.zeros((6, 6, 48)), *ok[2:])
  err("block_tables must be int32", q, lat, bt.astype(jnp.float32), *ok[3:])
  err(r"kv_lens shape \(3,\) must be \(2,\)", q, lat, bt, jnp.zeros((3,), jnp.int32), *ok[4:])
  err(r"cu_q_lens shape \(2,\) must be \(3,\)", q, lat, bt, kv, cu[:2], ok[5])
  err("block_h 4 must divide num_heads 2", *ok, block_h=4)
  err("unknown tuning options", *ok, pages_per_block=2)
  err("sm_scale must be > 0", *ok, sm_scale=-1.0)
  err("kernel must be one of", *ok, kernel="cuda")
  err("share_logits is an option of kernel='mosaic'", *ok, kernel="triton", share_logits=True)
  err("seesaw is an option of kernel='mosaic'", *ok, kernel="triton", seesaw=True)
  err("kernel='mosaic' takes bfloat16", *ok, kernel="mosaic")
  qb, lb = q.astype(jnp.bfloat16), lat.astype(jnp.bfloat16)
  err("kernel='mosaic' needs kv_lora_rank % 128 == 0", qb, lb, *ok[2:], kernel="mosaic")
  err("kernel='mosaic' takes block_q, block_h.*'value_split'", *ok, kernel="mosaic",
      value_split=2)
  err("uniform_q_len must be None or an int q with num_tokens 4 == num_seqs_max 2 \\* q, "
      "got 3", jnp.zeros((4, 2, 192), jnp.bfloat16), jnp.zeros((6, 8, 192), jnp.bfloat16),
      *ok[2:], kv_lora_rank=128, kernel="mosaic", uniform_q_len=3)
  err("share_logits must be a bool, got 2", jnp.zeros((4, 2, 192), jnp.bfloat16),
      jnp.zeros((6, 8, 192), jnp.bfloat16), *ok[2:], kv_lora_rank=128, kernel="mosaic",
      share_logits=2)
  err("seesaw must be a bool, got 2", jnp.zeros((4, 2, 192), jnp.bfloat16),
      jnp.zeros((6, 8, 192), jnp.bfloat16), *ok[2:], kv_lora_rank=128, kernel="mosaic",
      seesaw=2)
  err("seesaw=True: needs 64 rope columns .* got block_k 128",
      jnp.zeros((4, 2, 192), jnp.bfloat16), jnp.zeros((6, 8, 192), jnp.bfloat16), *ok[2:],
      kv_lora_rank=128, kernel="mosaic", seesaw=True, block_k=128)
  err("num_stages=3 with block_k=64 needs 305152 B of shared memory; it takes >= 2 stages",
      jnp.zeros((4, 2, 576), jnp.bfloat16), jnp.zeros((6, 64, 576), jnp.bfloat16), *ok[2:],
      kv_lora_rank=512, kernel="mosaic", num_stages=3)
  # The Mosaic kernel's own entry (it takes the max of the unscaled logits).
  from pallas_kernels.mla_paged_attention.kernel_mgpu import mla_tiles_mgpu
  with pytest.raises(ValueError, match="sm_scale must be > 0, got -0.5"):
    mla_tiles_mgpu(jnp.zeros((1, 64, 192), jnp.bfloat16), jnp.zeros((2, 64, 192), jnp.bfloat16),
                   bt, kv[:1], kv[:1], kv[:1], rank=128, block_h=64, sm_scale=-0.5)


def test_default_kernel_is_mosaic_only_on_hopper_where_it_fits(monkeypatch):
  import importlib

  import jax
  # The module (the package re-exports a function of the same name).
  mod = importlib.import_module("pallas_kernels.mla_paged_attention.mla_paged_attention")

  class Dev:
    platform = "gpu"
    compute_capability = "9.0"

  monkeypatch.delenv("MTPJAX_MLA_KERNEL", raising=False)
  monkeypatch.setattr(jax, "devices", lambda *a: [Dev()])
  q = jnp.zeros((2, 16, 576), jnp.bfloat16)
  lat = jnp.zeros((4, 64, 576), jnp.bfloat16)
  assert mod.default_kernel(q, lat, 512, interpret=False) == "mosaic"
  assert mod.default_kernel(q, lat, 512, interpret=True) == "triton"
  assert mod.default_kernel(q.astype(jnp.float32), lat, 512, interpret=False) == "triton"
  assert mod.default_kernel(q[..., :48], lat[..., :48], 32, interpret=False) == "triton"
  assert mod.default_kernel(q, lat[:, :4], 512, interpret=False) == "triton"
  Dev.compute_capability = "8.0"
  assert mod.default_kernel(q, lat, 512, interpret=False) == "triton"
  monkeypatch.setenv("MTPJAX_MLA_KERNEL", "mosaic")
  assert mod.default_kernel(q, lat, 512, interpret=True) == "mosaic"
  monkeypatch.setenv("MTPJAX_MLA_KERNEL", "cuda")
  with pytest.raises(ValueError, match="MTPJAX_MLA_KERNEL must be one of"):
    mod.default_kernel(q, lat, 512, interpret=False)
