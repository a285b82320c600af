"""Speculative decoding end to end: lossless greedy and sampling, incremental == from scratch."""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtpjax
from mtpjax import SamplingParams, SpecConfig
from mtpjax.cache import init_cache
from mtpjax.generate import plan_pages
from mtpjax.speculative.mixed_step import SlotState
from mtpjax.model.mtp import mtp_forward
from mtpjax.sampling import SamplingArrays, filtered_probs
from mtpjax.sampling import Limits
from mtpjax.model.backend import AttentionBackend

REFERENCE = AttentionBackend("reference")
from tests.conftest import tiny_config
from tests.speculative.test_accept import chi2_pvalue

gen = importlib.import_module("mtpjax.generate")   # the module (mtpjax.generate is the function)

# (method, K, D): K = 1, chain reusing one module (K > D) and cycling two, multi_layer with
# the first two of three modules (K < D; K = D = 2 runs in the tests below). (K 2 chain and multi_layer at D = 1, 2, 4 repeated these at a minute of
# compile each; the engine, no-weight-copies and DeepSeek tests run multi_layer D = 2 too.)
CASES = [("chain", 1, 1), ("chain", 3, 2), ("chain", 4, 1), ("multi_layer", 2, 3)]


def _model(V, D, seed):
    cfg = tiny_config(vocab_size=V, num_mtp_layers=D)
    return cfg, mtpjax.init_params(cfg, jax.random.PRNGKey(seed), std=0.3)


@pytest.mark.parametrize("method,K,D", CASES)
def test_lossless_greedy(method, K, D):
    """Model drafts (partial acceptance), random drafts (mostly rejected) and the target's own
    continuation as drafts (all accepted), one batch with prompts of different lengths."""
    seed = K + 10 * D
    cfg, params = _model(16, D, seed)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 16, size=n).tolist() for n in (5, 1, 9)]
    spec = SpecConfig(num_speculative_tokens=K, method=method)
    n_new = 12
    ref = mtpjax.generate(params, cfg, prompts, max_new_tokens=n_new + 4, page_size=4)
    want = [r[:n_new] for r in ref.tokens]
    sources = ["model"] * 3 + ["random"] * 3 + ["forced"] * 3
    forced = np.zeros((9, 9 + n_new + 4 + 2 * K + 2), np.int32)
    for i, (p, r) in enumerate(zip(prompts, ref.tokens)):
        forced[6 + i, :len(p) + len(r)] = p + r
    out = mtpjax.generate(params, cfg, prompts * 3, max_new_tokens=n_new, spec=spec,
                          page_size=4, draft_source=sources, forced_drafts=forced)
    assert out.tokens == want * 3
    # separately for the stats: the oracle alone accepts every draft
    oracle = mtpjax.generate(params, cfg, prompts, max_new_tokens=n_new, spec=spec, page_size=4,
                             draft_source="forced", forced_drafts=forced[6:])
    assert oracle.tokens == want
    assert oracle.stats["acceptance_rate"] == 1.0
    for o in (out, oracle):
        s = o.stats
        assert s["generated_tokens"] == sum(len(t) for t in o.tokens)
        assert sum(s["num_accepted_histogram"]) == s["verify_steps"]
        assert sum(i * c for i, c in enumerate(s["num_accepted_histogram"])) == s["committed_tokens"]
        assert s["proposed_draft_tokens"] == K * s["verify_steps"]
        assert np.all(np.diff(s["per_position_acceptance"]) <= 1e-12)


@pytest.mark.parametrize("method,K,D", [("chain", 3, 1), ("multi_layer", 2, 2)])
def test_lossless_greedy_large_vocab_batch_one_and_stops(method, K, D):
    cfg, params = _model(96, D, 3)
    spec = SpecConfig(num_speculative_tokens=K, method=method)
    prompt = [[5, 17, 33, 2]]
    ref = mtpjax.generate(params, cfg, prompt, max_new_tokens=20)
    out = mtpjax.generate(params, cfg, prompt, max_new_tokens=20, spec=spec)
    assert out.tokens == ref.tokens
    # a stop token inside an accepted run truncates exactly (forced drafts accept everything)
    stop = ref.tokens[0][6]
    forced = np.zeros((1, 64), np.int32)
    forced[0, :24] = prompt[0] + ref.tokens[0]
    sp = SamplingParams(stop_token_ids=(stop,))
    cut = mtpjax.generate(params, cfg, prompt, max_new_tokens=20, spec=spec, sampling=sp,
                          draft_source="forced", forced_drafts=forced)
    assert cut.tokens[0] == ref.tokens[0][: ref.tokens[0].index(stop) + 1]
    capped = mtpjax.generate(params, cfg, prompt, max_new_tokens=20, spec=spec,
                             sampling=SamplingParams(max_tokens=5), draft_source="forced",
                             forced_drafts=forced)
    assert capped.tokens[0] == ref.tokens[0][:5]


@pytest.mark.parametrize("method,K,D,sp", [
    ("chain", 2, 1, SamplingParams(temperature=1.0)),
    ("multi_layer", 2, 2, SamplingParams(temperature=0.8, top_k=5, top_p=0.9)),
])
def test_lossless_sampling_distribution(method, K, D, sp):
    """Joint law of the first generated tokens under spec decoding == the target's exact law."""
    V = 8
    cfg, params = _model(V, D, 21)
    prompt = [1, 2, 3]
    n, chunk = 3000, 500    # 6 batches of 500 (one compile): a 3000-row program crashed XLA:CPU
    spec = SpecConfig(num_speculative_tokens=K, method=method)
    greedy_every = 10       # greedy requests mixed into the same batch
    sps = [SamplingParams() if i % greedy_every == 0 else sp for i in range(chunk)]
    toks = np.concatenate([np.asarray(mtpjax.generate(
        params, cfg, [prompt] * chunk, max_new_tokens=3, spec=spec, sampling=sps,
        seed=5 + c).tokens) for c in range(n // chunk)])
    greedy_ref = mtpjax.generate(params, cfg, [prompt], max_new_tokens=3).tokens[0]
    assert all(toks[i].tolist() == greedy_ref for i in range(0, n, greedy_every))
    sampled = np.asarray([t for i, t in enumerate(toks) if i % greedy_every])
    # exact distributions by enumeration of all prefixes
    t1, t2 = np.meshgrid(np.arange(V), np.arange(V), indexing="ij")
    seqs = np.concatenate([np.tile(prompt, (V * V, 1)), t1.reshape(-1, 1), t2.reshape(-1, 1)], 1)
    logits = mtpjax.forward(params, cfg, jnp.asarray(seqs))                 # [V*V, 5, V]
    f = functools.partial(filtered_probs, temperature=jnp.full((V * V,), sp.temperature),
                          top_k=jnp.full((V * V,), sp.top_k), top_p=jnp.full((V * V,), sp.top_p))
    p1 = np.asarray(f(logits[:, 2]))[0]                                      # p(t1)
    p2 = np.asarray(f(logits[:, 3])).reshape(V, V, V)[:, 0]                  # p(t2 | t1)
    p3 = np.asarray(f(logits[:, 4])).reshape(V, V, V)                        # p(t3 | t1, t2)
    joint12 = p1[:, None] * p2
    counts12 = np.bincount(sampled[:, 0] * V + sampled[:, 1], minlength=V * V)
    assert chi2_pvalue(counts12, joint12.reshape(-1)) > 1e-3
    marg3 = np.einsum("ab,abc->c", joint12, p3)
    assert chi2_pvalue(np.bincount(sampled[:, 2], minlength=V), marg3) > 1e-3


# ---------------------------------------------------------------- incremental == from scratch

LMAX = 64   # reference inputs are right-padded to one length: causal, so padding is inert


def _pad(a, axis=1):
    width = [(0, 0)] * a.ndim
    width[axis] = (0, LMAX - a.shape[axis])
    return jnp.pad(a, width)


@functools.lru_cache(maxsize=None)
def _jitted(cfg):
    fwd = jax.jit(lambda p, t: mtpjax.forward(p, cfg, t, return_hidden=True))
    mtp = jax.jit(lambda p, k, h, t: mtp_forward(p, cfg, k, h, t), static_argnums=1)
    return fwd, mtp


def _reference_draft_probs(params, cfg, spec, seq, drafts, sp):
    """From-scratch draft distributions for one request, from the module formula (docs/models.md).

    seq: committed tokens x_0..x_N (x_N pending); drafts: d_1..d_K the step drew.
    """
    K, D = spec.num_speculative_tokens, cfg.num_mtp_layers
    N = len(seq) - 1
    fwd, mtp = _jitted(cfg)
    _, h0 = fwd(params, _pad(jnp.asarray([seq[:N]])))                   # [1, LMAX, E]
    filt = lambda lg: np.asarray(filtered_probs(lg[None], jnp.asarray([sp.temperature]),
                                                jnp.asarray([sp.top_k]),
                                                jnp.asarray([sp.top_p])))[0]
    ext = list(seq) + list(drafts)
    probs = []
    if spec.method == "multi_layer":
        h = h0
        for k in range(K):
            h, lg = mtp(params, k, h, _pad(jnp.asarray([ext[k + 1:k + 1 + N]])))
            probs.append(filt(lg[0, N - 1]))
        return np.stack(probs)
    # chain: positions < N take (h0_p, x_{p+1}); position N-1+s takes (hc_{s-1}, d_s)
    hid = h0[0, :N]
    tok = jnp.asarray(ext[1:N + 1])
    h_next, lg = mtp(params, 0, h0, _pad(tok[None]))
    probs.append(filt(lg[0, N - 1]))
    hc = h_next[0, N - 1]
    for s in range(1, K):
        hid = jnp.concatenate([hid, hc[None]])
        tok = jnp.concatenate([tok, jnp.asarray([drafts[s - 1]])])
        h_next, lg = mtp(params, s % D, _pad(hid[None]), _pad(tok[None]))
        probs.append(filt(lg[0, N - 1 + s]))
        hc = h_next[0, N - 1 + s]
    return np.stack(probs)


@pytest.mark.parametrize("method,K,D", [("chain", 3, 1), ("chain", 3, 2), ("multi_layer", 3, 3)])
def test_incremental_drafts_equal_from_scratch(method, K, D):
    cfg, params = _model(32, D, 7)
    spec = SpecConfig(num_speculative_tokens=K, method=method, acceptance="synthetic",
                      synthetic_accept_rate=0.5)     # random accept/reject patterns
    sp = SamplingParams(temperature=1.0)
    prompts = [[3, 1, 4, 1, 5, 9, 2], [6, 5]]
    tables, num_pages = plan_pages([len(p) + 40 for p in prompts], 4, None, 0)
    cache = init_cache(cfg, num_pages, 4)
    spa = SamplingArrays.build([sp, sp], 0)
    lim = Limits(max_new=jnp.asarray([30, 30]), stop_ids=jnp.full((2, 1), -1, jnp.int32))
    batch, F = gen.prefill_batch(prompts, spec, spa, tables)
    slots = SlotState.create(cfg, spec, cache, len(prompts))
    state = jax.jit(gen.generate_prefill, static_argnames=(
        "cfg", "spec", "first_pass_len", "max_new", "backend"))(
        params, cfg, spec, slots, jax.device_put(batch), lim, first_pass_len=F, max_new=30,
        backend=REFERENCE)
    step = jax.jit(gen.generate_step, static_argnames=("cfg", "spec", "backend"))
    patterns = set()
    for it in range(6):
        for b, p in enumerate(prompts):
            seq = p + np.asarray(state.out_tokens[b, :int(state.num_out[b])]).tolist()
            assert len(seq) - 1 == int(state.slots.seq_len[b])
            ref = _reference_draft_probs(params, cfg, spec, seq,
                                         np.asarray(state.slots.drafts[b]).tolist(), sp)
            np.testing.assert_allclose(np.asarray(state.slots.draft_probs[b]), ref, atol=2e-5)
            # the cached target hidden window equals the from-scratch target hidden states
            _, h0 = _jitted(cfg)[0](params, _pad(jnp.asarray([seq[:-1]])))
            W = state.slots.hist_hidden.shape[1]
            N = len(seq) - 1
            n = min(W, N)
            np.testing.assert_allclose(np.asarray(state.slots.hist_hidden[b, W - n:]),
                                       np.asarray(h0[0, N - n:N]), atol=2e-5)
        before = np.asarray(state.num_out)
        state = step(params, cfg, spec, state, spa, lim, backend=REFERENCE)
        patterns.update((np.asarray(state.num_out) - before).tolist())
    assert len(patterns) >= 2      # the accept/reject pattern really varied
