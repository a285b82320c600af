"""The acceptance rules' input contract (mtpjax/speculative/accept.py docstring), as research
code calling them directly meets it: zero draft slots, draft ids outside the vocabulary, drafts
the draft distribution gives probability 0 (cases from vLLM's rejection-sampler tests), the
on-device rejection that leaves valid inputs' results unchanged, and the checkify mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from mtpjax.sampling import sample_from_probs
from mtpjax.speculative import accept as rules
from mtpjax.speculative.accept import checked, contract_checks

V, B = 16, 4
# jitted: run op by op, each rule's vmapped draws and gathers compiled one primitive at a time
accept_greedy, accept_rejection, accept_coupled, accept_synthetic = (
    jax.jit(f) for f in (rules.accept_greedy, rules.accept_rejection, rules.accept_coupled,
                         rules.accept_synthetic))
accept_relaxed = jax.jit(rules.accept_relaxed,
                         static_argnames=("topk", "delta", "think_start", "think_end"))


def _dist(seed, shape, alpha=0.5):
    """Random distributions over V (numpy: eager jax.random.dirichlet compiles for seconds)."""
    return jnp.asarray(np.random.default_rng(seed).dirichlet(np.full(V, alpha), shape),
                       jnp.float32)


def _draw(seed, q):
    """A draft sampled from each row of q [..., V] (so q(draft) > 0)."""
    rng = np.random.default_rng(seed)
    q = np.asarray(q, np.float64)
    cdf = np.cumsum(q / q.sum(-1, keepdims=True), -1)
    u = rng.random(q.shape[:-1] + (1,))
    return jnp.asarray(np.minimum((u > cdf).sum(-1), V - 1), jnp.int32)


def _keys(seed=0, n=B):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 2 ** 32, (n, 2), dtype=np.uint32))


def _relaxed(logits, d, nd):
    return accept_relaxed(logits, d, nd, jnp.zeros(d.shape[0], bool), topk=2, delta=0.5,
                          think_start=V - 2, think_end=V - 1)[:2]


RULES = {     # rule name -> (rule called on (p, q, drafts, num_drafts, keys)), for K >= 0
    "greedy": lambda p, q, d, nd, k: accept_greedy(jnp.log(p), d, nd),
    "rejection": lambda p, q, d, nd, k: accept_rejection(p, q, d, nd, k),
    "coupled": lambda p, q, d, nd, k: accept_coupled(
        p, d, nd, jnp.stack([jax.random.split(x, p.shape[1]) for x in k])),
    "relaxed": lambda p, q, d, nd, k: _relaxed(jnp.log(p), d, nd),
    "synthetic": lambda p, q, d, nd, k: accept_synthetic(jnp.log(p), d, nd,
                                                         jnp.ones((d.shape[1],)), k),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_zero_draft_slots_take_one_token(rule):
    """K = 0: target [B, 1, V], drafts [B, 0]: each row commits exactly one token, the target's
    (accept_rejection returned a [B, 0] token array while counting 1 accepted)."""
    onehot = jax.nn.one_hot(jnp.arange(B) + 3, V)[:, None, :]                     # [B, 1, V]
    p = 0.999 * onehot + 0.001 / V
    tok, num = RULES[rule](p, jnp.zeros((B, 0, V)), jnp.zeros((B, 0), jnp.int32),
                           jnp.zeros((B,), jnp.int32), _keys())
    assert tok.shape == (B, 1) and num.tolist() == [1] * B
    if rule != "rejection":       # rejection draws from p: the argmax with probability 0.999
        assert tok[:, 0].tolist() == (jnp.arange(B) + 3).tolist()


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("bad", [-1, V, V + 7])
def test_out_of_range_draft_ids_are_never_committed(rule, bad):
    """A draft id outside [0, V) is rejected by every rule. For rejection sampling -1 read
    p[V-1] / q[V-1] and was committed as -1; here p and q put all mass on V-1."""
    K = 2
    p = jnp.broadcast_to(jax.nn.one_hot(V - 1, V), (B, K + 1, V))
    q = jnp.broadcast_to(jax.nn.one_hot(V - 1, V), (B, K, V))
    d = jnp.full((B, K), bad, jnp.int32)
    tok, num = RULES[rule](p, q, d, jnp.full((B,), K, jnp.int32), _keys())
    assert num.tolist() == [1] * B
    tok = np.asarray(tok)
    assert ((tok[:, :1] >= 0) & (tok[:, :1] < V)).all()


def test_a_draft_with_draft_probability_zero_is_rejected():
    """vLLM rejects a draft q gives probability 0 (the drafter cannot have sampled it); the
    test u * q(d) < p(d) kept it whenever p(d) > 0."""
    K = 2
    p = _dist(1, (B, K + 1))
    q = _dist(2, (B, K)).at[:, :, 5].set(0.0)
    q = q / q.sum(-1, keepdims=True)
    d = jnp.full((B, K), 5, jnp.int32)
    for seed in range(5):
        _, num = accept_rejection(p, q, d, jnp.full((B,), K, jnp.int32), _keys(seed))
        assert num.tolist() == [1] * B


def _old_accept_rejection(target_probs, draft_probs, draft_tokens, num_drafts, keys):
    """accept_rejection before the contract was enforced (valid inputs only)."""
    B_, K1, _ = target_probs.shape
    K = K1 - 1
    k_accept, k_resample = jax.vmap(lambda k: jax.random.split(k, 2))(keys).transpose(1, 0, 2)
    u = jax.vmap(lambda k: jax.random.uniform(k, (K,)))(k_accept)
    p_d = jnp.take_along_axis(target_probs[:, :K], draft_tokens[..., None], -1)[..., 0]
    q_d = jnp.take_along_axis(draft_probs, draft_tokens[..., None], -1)[..., 0]
    ok = (u * q_d < p_d) & (jnp.arange(K)[None, :] < num_drafts[:, None])
    n = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    p_n = jnp.take_along_axis(target_probs, n[:, None, None], 1)[:, 0]
    q_pad = jnp.concatenate([draft_probs, jnp.zeros_like(draft_probs[:, :1])], axis=1)
    q_n = jnp.take_along_axis(q_pad, n[:, None, None], 1)[:, 0]
    residual = jnp.maximum(p_n - q_n, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    dist = jnp.where((n < num_drafts)[:, None] & (mass > 0),
                     residual / jnp.where(mass > 0, mass, 1.0), p_n)
    last = sample_from_probs(dist, k_resample)
    drafts_pad = jnp.concatenate([draft_tokens, jnp.zeros_like(draft_tokens[:, :1])], axis=1)
    tokens = jnp.where(jnp.arange(K1)[None, :] == n[:, None], last[:, None], drafts_pad)
    return tokens.astype(jnp.int32), (n + 1).astype(jnp.int32)


def test_valid_inputs_give_exactly_the_results_of_before(K=3):
    """Drafts sampled from q (so q(d) > 0), num_drafts in [0, K]: bit-identical outputs."""
    n = 256
    p = _dist(10 * K, (n, K + 1), alpha=0.3)
    q = _dist(10 * K + 1, (n, K), alpha=0.3)
    d = _draw(K, q)
    nd = jnp.asarray(np.random.default_rng(K).integers(0, K + 1, n), jnp.int32)
    keys = _keys(K, n)
    new = accept_rejection(p, q, d, nd, keys)
    old = jax.jit(_old_accept_rejection)(p, q, d, nd, keys)
    np.testing.assert_array_equal(new[1], old[1])
    live = np.arange(K + 1)[None, :] < np.asarray(new[1])[:, None]
    np.testing.assert_array_equal(np.where(live, new[0], 0), np.where(live, old[0], 0))


def _valid(K=2):
    p = _dist(3, (B, K + 1))
    q = _dist(4, (B, K))
    d = _draw(5, q)
    return p, q, d, jnp.full((B,), K, jnp.int32), _keys()


@pytest.mark.parametrize("case, match", [
    ("draft_id", r"draft_tokens\[b, i\] for i < num_drafts\[b\] must be in \[0, V=16\)"),
    ("q_zero", r"draft_probs\[b, i, draft_tokens\[b, i\]\] must be > 0"),
    ("num_drafts", r"num_drafts must be in \[0, K=2\]"),
    ("not_normalized", r"target_probs rows must sum to 1"),
    ("negative", r"draft_probs must be finite and >= 0"),
])
def test_checked_mode_refuses_each_broken_clause(case, match):
    p, q, d, nd, keys = _valid()
    if case == "draft_id":
        d = d.at[1, 0].set(-1)
    elif case == "q_zero":
        q = q.at[0, 0].set(jax.nn.one_hot((d[0, 0] + 1) % V, V))
    elif case == "num_drafts":
        nd = nd.at[2].set(3)
    elif case == "not_normalized":
        p = p * 2
    else:
        q = q.at[0, 0, 0].set(-0.5)
    with pytest.raises(checkify.JaxRuntimeError, match=match):
        checked(rules.accept_rejection)(p, q, d, nd, keys)


def test_checked_mode_ignores_draft_slots_past_num_drafts():
    """Entries past num_drafts are padding (any value): not checked, not used."""
    p, q, d, nd, keys = _valid()
    assert checked(rules.accept_rejection)(p, q, d, nd, keys) is not None   # valid: no error
    d, nd = d.at[:, 1].set(-1), jnp.ones((B,), jnp.int32)
    assert checked(rules.accept_rejection)(p, q, d, nd, keys)[1].max() <= 2
    assert checked(rules.accept_greedy)(jnp.log(p), d, nd)[1].max() <= 2
    assert checked(rules.accept_relaxed)(jnp.log(p), d, nd, jnp.zeros(B, bool), topk=2,
                                         delta=0.5, think_start=1, think_end=2)[1].max() <= 2


def test_contract_checks_inside_a_jitted_checkified_function():
    p, q, d, nd, keys = _valid()

    def f(p, q, d, nd, keys):
        contract_checks(d, nd, p, draft_probs=q, target_is_probs=True)
        return rules.accept_rejection(p, q, d, nd, keys)

    run = jax.jit(checkify.checkify(f))
    err, _ = run(p, q, d, nd, keys)
    assert err.get() is None
    err, _ = run(p, q, d.at[0, 1].set(V), nd, keys)
    assert "must be in [0, V=16)" in err.get()


def test_shapes_are_checked_when_traced():
    p, q, d, nd, keys = _valid()
    with pytest.raises(ValueError, match=r"accept_rejection: draft_tokens must be \[B, K\]"):
        accept_rejection(p, q, d[:, :1], nd, keys)
    with pytest.raises(ValueError, match=r"accept_rejection: draft_probs must be \[B, K, V\]"):
        accept_rejection(p, q[:, :1], d, nd, keys)
    with pytest.raises(ValueError, match=r"accept_greedy: num_drafts must be \[B\]"):
        accept_greedy(jnp.log(p), d, nd[:2])
    with pytest.raises(ValueError, match="checked\\(\\) takes one of"):
        checked(sample_from_probs)
