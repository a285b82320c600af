"""Cached paths == the plain forward: prefill + step-by-step decode through a paged cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtpjax
from mtpjax.cache import PagedBatch, init_cache
from mtpjax.model.mtp import mtp_forward, mtp_forward_cached
from mtpjax.model.transformer import forward_cached, logits_from_hidden
from mtpjax.model.backend import AttentionBackend

REFERENCE = AttentionBackend("reference")
from tests.conftest import tiny_config

VARIANTS = {
    "llama_gqa": dict(),
    "qwen2_bias": dict(model_type="qwen2", qkv_bias=True),
    "qwen3_qknorm": dict(model_type="qwen3", qk_norm=True, head_dim=16),
    "mha_tied": dict(num_kv_heads=4, tie_word_embeddings=True),
}


def _perturbed_params(cfg, seed):
    """Random params with norms and biases moved off their init so they matter."""
    params = mtpjax.init_params(cfg, jax.random.PRNGKey(seed), std=0.2)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed + 1000), len(leaves))
    leaves = [l + 0.1 * jax.random.normal(k, l.shape) for l, k in zip(leaves, keys)]
    return jax.tree.unflatten(tree, leaves)


def _nan_cache(cfg, num_pages, page_size):
    cache = init_cache(cfg, num_pages, page_size)
    return jax.tree.map(lambda a: jnp.full_like(a, jnp.nan), cache)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prefill_then_decode_matches_forward(variant, seed):
    cfg = tiny_config(**VARIANTS[variant])
    params = _perturbed_params(cfg, seed)
    rng = np.random.default_rng(seed)
    page_size = int(rng.choice([2, 4, 8]))
    lens = rng.integers(1, 12, size=3)
    total = int(lens.max()) + 6
    seqs = rng.integers(0, cfg.vocab_size, size=(3, total))
    pages_per = -(-total // page_size)
    num_pages = 3 * pages_per + 5                      # spare pages stay NaN
    perm = rng.permutation(num_pages)[: 3 * pages_per].reshape(3, pages_per)
    tables = jnp.asarray(perm, jnp.int32)
    cache = _nan_cache(cfg, num_pages, page_size)

    ref_logits = mtpjax.forward(params, cfg, jnp.asarray(seqs))       # [3, total, V]

    T = int(lens.max())
    tok = np.zeros((3, T), np.int32)
    pos = np.full((3, T), -1, np.int32)
    for i, n in enumerate(lens):           # left padded, as generate packs prompts
        tok[i, T - n:] = seqs[i, :n]
        pos[i, T - n:] = np.arange(n)
    batch = PagedBatch.uniform(jnp.asarray(pos), tables)
    hidden, cache = forward_cached(params, cfg, cache, jnp.asarray(tok).reshape(-1), batch,
                                   backend=REFERENCE)
    logits = logits_from_hidden(params, hidden).reshape(3, T, -1)
    for i, n in enumerate(lens):
        np.testing.assert_allclose(logits[i, T - n:], ref_logits[i, :n], atol=2e-5, rtol=1e-4)

    seq_len = jnp.asarray(lens, jnp.int32)
    for _ in range(6):
        batch = PagedBatch.uniform(seq_len[:, None], tables)
        step_tok = jnp.asarray(seqs)[jnp.arange(3), seq_len]
        hidden, cache = forward_cached(params, cfg, cache, step_tok, batch, backend=REFERENCE)
        step_logits = logits_from_hidden(params, hidden)
        want = ref_logits[jnp.arange(3), seq_len]
        np.testing.assert_allclose(step_logits, want, atol=2e-5, rtol=1e-4)
        seq_len = seq_len + 1


@pytest.mark.parametrize("order", ["embed_hidden", "hidden_embed"])
@pytest.mark.parametrize("normed", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_mtp_module_cached_matches_dense(order, normed, seed):
    cfg = tiny_config(num_mtp_layers=2, mtp_concat_order=order, mtp_normed_hidden_to_next=normed)
    params = _perturbed_params(cfg, seed)
    rng = np.random.default_rng(seed)
    B, T, ps = 2, 9, 4
    seqs = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(B, T)), jnp.int32)
    hprev = jnp.asarray(rng.normal(size=(B, T, cfg.hidden_size)), jnp.float32)
    for k in range(cfg.num_mtp_layers):
        h_ref, lg_ref = mtp_forward(params, cfg, k, hprev, seqs)
        pages = 2 * 3 + 2
        tables = jnp.asarray(rng.permutation(pages)[:6].reshape(2, 3), jnp.int32)
        cache = _nan_cache(cfg, pages, ps)
        # first 5 positions as one chunk, then the rest one token at a time
        pos = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (B, 5))
        batch = PagedBatch.uniform(pos, tables)
        h, normed, cache = mtp_forward_cached(params, cfg, k, cache,
                                              hprev[:, :5].reshape(B * 5, -1),
                                              seqs[:, :5].reshape(-1), batch, backend=REFERENCE)
        lg = logits_from_hidden(params, normed)
        np.testing.assert_allclose(lg.reshape(B, 5, -1), lg_ref[:, :5], atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(h.reshape(B, 5, -1), h_ref[:, :5], atol=2e-5, rtol=1e-4)
        for t in range(5, T):
            batch = PagedBatch.uniform(jnp.full((B, 1), t, jnp.int32), tables)
            h, normed, cache = mtp_forward_cached(params, cfg, k, cache, hprev[:, t], seqs[:, t],
                                                  batch, backend=REFERENCE)
            lg = logits_from_hidden(params, normed)
            np.testing.assert_allclose(lg, lg_ref[:, t], atol=2e-5, rtol=1e-4)
            np.testing.assert_allclose(h, h_ref[:, t], atol=2e-5, rtol=1e-4)


def test_mtp_zeroes_embedding_at_position_zero():
    cfg = tiny_config()
    params = _perturbed_params(cfg, 3)
    h = jnp.ones((1, 3, cfg.hidden_size))
    a, _ = mtp_forward(params, cfg, 0, h, jnp.asarray([[5, 6, 7]]))
    b, _ = mtp_forward(params, cfg, 0, h, jnp.asarray([[9, 6, 7]]))
    np.testing.assert_array_equal(a[0, 0], b[0, 0])     # token at position 0 is ignored
    assert not np.allclose(a[0, 1:], mtp_forward(params, cfg, 0, h, jnp.asarray([[5, 8, 7]]))[0][0, 1:])
