"""Sampling without vocabulary sorts unless a request asks for top-k / top-p, and without a
softmax or a random draw for all-greedy batches: outputs bit-identical to the implementation
that always sorted, and guards on the jaxpr / compiled HLO that the sorts stay in a branch."""

import re

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from mtpjax import SpecConfig
from mtpjax.sampling import (SamplingArrays, _top_k_mask, _top_p_mask, filtered_probs,
                             position_keys, sample, sample_from_probs)
from mtpjax.speculative.accept import accept_rejection, apply_acceptance

V = 48


# ---- the previous implementation (it always sorted), kept as the reference ---------------------

def _expand(x, logits):
    return x.reshape(x.shape + (1,) * (logits.ndim - 1))


def ref_filtered_probs(logits, temperature, top_k, top_p, top_p_one_is_off=True):
    """The previous filtered_probs. One intended change (top_p_one_is_off): top_p = 1 keeps
    every token; before, a token was dropped once the float32 running sum of the sorted
    probabilities reached 1.0 ahead of it (a tail of mass ~1e-7 and less, see
    test_top_p_one_is_off), which no implementation can reproduce without the sort."""
    logits = logits.astype(jnp.float32)
    V = logits.shape[-1]
    greedy = _expand(temperature, logits) <= 0
    t = jnp.where(greedy, 1.0, _expand(temperature, logits))
    scaled = logits / t
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k = _expand(top_k, logits)
    kth = jnp.take_along_axis(sorted_desc, jnp.clip(k - 1, 0, V - 1), axis=-1)
    scaled = jnp.where((k > 0) & (scaled < kth), -jnp.inf, scaled)
    probs = jax.nn.softmax(scaled, axis=-1)
    sorted_p = -jnp.sort(-probs, axis=-1)
    before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
    keep = before < _expand(top_p, logits)
    if top_p_one_is_off:
        keep = keep | (_expand(top_p, logits) >= 1)
    threshold = jnp.min(jnp.where(keep, sorted_p, jnp.inf), axis=-1, keepdims=True)
    probs = jnp.where(probs >= threshold, probs, 0.0)
    probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    onehot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), V, dtype=jnp.float32)
    return jnp.where(greedy, onehot, probs)


def ref_sample(logits, sp, positions):
    probs = ref_filtered_probs(logits, sp.temperature, sp.top_k, sp.top_p)
    logp = jnp.log(probs)
    keys = position_keys(sp.keys, positions)
    tok = jax.vmap(jax.random.categorical)(keys, logp).astype(jnp.int32)
    return jnp.where(sp.temperature <= 0, jnp.argmax(logits, axis=-1).astype(jnp.int32), tok)


def ref_apply_rejection(logits, drafts, draft_probs, num_drafts, sp, key_positions):
    keys = jax.vmap(jax.random.fold_in)(position_keys(sp.keys, key_positions),
                                        jnp.full(key_positions.shape, 1, jnp.uint32))
    p = ref_filtered_probs(logits, sp.temperature, sp.top_k, sp.top_p)
    return accept_rejection(p, draft_probs, drafts, num_drafts, keys)


def forced_sort_probs(logits, temperature, top_k, top_p):
    """The sorting path forced on for every batch (the branch a top-k / top-p batch takes)."""
    logits = logits.astype(jnp.float32)
    greedy = _expand(temperature, logits) <= 0
    scaled = logits / jnp.where(greedy, 1.0, _expand(temperature, logits))
    scaled = _top_k_mask(scaled, _expand(top_k, logits))
    probs = _top_p_mask(jax.nn.softmax(scaled, axis=-1), _expand(top_p, logits))
    probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    onehot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jnp.where(greedy, onehot, probs)


# ---- batches --------------------------------------------------------------------------------

ROW_KINDS = {
    "greedy": lambda r: (0.0, int(r.choice([0, 5])), float(r.choice([1.0, 0.5]))),
    "temperature": lambda r: (float(r.choice([0.4, 1.0, 1.7])), 0, 1.0),
    "top_k": lambda r: (float(r.choice([0.7, 1.0])), int(r.choice([1, 3, 17, V, V + 9])), 1.0),
    "top_p": lambda r: (float(r.choice([0.7, 1.0])), 0, float(r.choice([0.2, 0.8, 0.95]))),
    "both": lambda r: (1.0, int(r.choice([2, 9])), float(r.choice([0.5, 0.9]))),
}
BATCHES = {
    "all_greedy": ["greedy"],
    "greedy_temperature": ["greedy", "temperature"],
    "temperature": ["temperature"],
    "with_top_k": ["greedy", "temperature", "top_k"],
    "with_top_p": ["greedy", "temperature", "top_p"],
    "mixed": list(ROW_KINDS),
}


def _batch(kinds, B, seed, scale):
    r = np.random.default_rng(seed)
    rows = [ROW_KINDS[kinds[i % len(kinds)]](r) for i in range(B)]
    temp, top_k, top_p = (np.asarray(c) for c in zip(*rows))
    sp = SamplingArrays(temperature=jnp.asarray(temp, jnp.float32),
                        top_k=jnp.asarray(top_k, jnp.int32),
                        top_p=jnp.asarray(top_p, jnp.float32),
                        keys=jax.random.split(jax.random.PRNGKey(seed), B))
    logits = jnp.asarray(scale * r.standard_normal((B, 4, V)), jnp.float32)
    return sp, logits, r


def _filters(sp):
    return sp.temperature, sp.top_k, sp.top_p


jit_filtered = jax.jit(filtered_probs)
jit_ref_filtered = jax.jit(ref_filtered_probs)
jit_forced = jax.jit(forced_sort_probs)
jit_sample = jax.jit(sample)
jit_ref_sample = jax.jit(ref_sample)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("batch", list(BATCHES))
def test_filtered_probs_and_sample_bit_identical(batch, seed):
    B = 11
    sp, logits, r = _batch(BATCHES[batch], B, seed, scale=2.0)
    for lg in (logits, logits[:, 0]):                    # [B, K+1, V] and [B, V]
        new = np.asarray(jit_filtered(lg, *_filters(sp)))
        np.testing.assert_array_equal(new, np.asarray(jit_ref_filtered(lg, *_filters(sp))))
        np.testing.assert_array_equal(new, np.asarray(jit_forced(lg, *_filters(sp))))
    positions = jnp.asarray(r.integers(0, 1000, B), jnp.int32)
    np.testing.assert_array_equal(np.asarray(jit_sample(logits[:, 0], sp, positions)),
                                  np.asarray(jit_ref_sample(logits[:, 0], sp, positions)))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("batch", list(BATCHES))
def test_fast_path_equals_forced_sort_on_peaked_logits(batch, seed):
    """Peaked rows (logit scale 40) where the running sum of the sorted probabilities reaches
    1.0 in float32 before the tail: the fast path still equals the sorting path bit for bit."""
    sp, logits, _ = _batch(BATCHES[batch], 9, seed, scale=40.0)
    np.testing.assert_array_equal(np.asarray(jit_filtered(logits, *_filters(sp))),
                                  np.asarray(jit_forced(logits, *_filters(sp))))


def test_top_p_one_is_off():
    """top_p = 1 keeps every token. The previous implementation dropped tokens whose probability
    is below float32 rounding of the running sum (here p ~ 1e-13), and so did this row only when
    it shared a batch with a top-p request; now it is off in both cases."""
    row = np.full(V, -30.0, np.float32)
    row[7] = 0.0
    logits = jnp.asarray(np.stack([row, row]))
    temp = jnp.asarray([1.0, 1.0])
    top_k = jnp.asarray([0, 0], jnp.int32)
    alone = np.asarray(filtered_probs(logits, temp, top_k, jnp.asarray([1.0, 1.0])))
    with_top_p = np.asarray(filtered_probs(logits, temp, top_k, jnp.asarray([1.0, 0.5])))
    assert np.all(alone > 0)
    np.testing.assert_array_equal(with_top_p[0], alone[0])
    assert np.count_nonzero(with_top_p[1]) == 1                        # the nucleus of 0.5
    old = np.asarray(ref_filtered_probs(logits, temp, top_k, jnp.asarray([1.0, 1.0]),
                                        top_p_one_is_off=False))
    assert np.count_nonzero(old[0]) == 1                               # the old behaviour


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("batch", list(BATCHES))
def test_apply_acceptance_rejection_bit_identical(batch, seed):
    B, K = 11, 3
    sp, logits, r = _batch(BATCHES[batch], B, seed, scale=2.0)
    draft_logits = logits[:, :K] + jnp.asarray(r.standard_normal((B, K, V)), jnp.float32)
    q = ref_filtered_probs(draft_logits, *_filters(sp))
    drafts = sample_from_probs(q.reshape(B * K, V),
                               jax.random.split(jax.random.PRNGKey(99 + seed), B * K)).reshape(B, K)
    # some rows with uniform random drafts / the target's argmax (partial and full acceptance)
    pick = r.integers(0, 3, B)
    target = jnp.argmax(logits[:, :K], axis=-1).astype(jnp.int32)
    rand = jnp.asarray(r.integers(0, V, (B, K)), jnp.int32)
    drafts = jnp.where((pick == 1)[:, None], rand, jnp.where((pick == 2)[:, None], target, drafts))
    q = jnp.where((pick == 1)[:, None, None], 1.0 / V, q)
    num_drafts = jnp.asarray(np.where(r.random(B) < 0.2, 0, K), jnp.int32)   # prefill rows
    key_pos = jnp.asarray(r.integers(0, 500, B), jnp.int32)
    thinking = jnp.zeros((B,), bool)
    spec = SpecConfig(num_speculative_tokens=K)
    tok, num, _ = jax.jit(apply_acceptance, static_argnums=0)(
        spec, logits, drafts, q, num_drafts, thinking, sp, key_pos)
    ref_tok, ref_num = jax.jit(ref_apply_rejection)(logits, drafts, q, num_drafts, sp, key_pos)
    np.testing.assert_array_equal(np.asarray(num), np.asarray(ref_num))
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(ref_tok))


# ---- guards: the sorts (and, for all-greedy batches, softmax / draws) live in a branch ------------

def _primitives(jaxpr, in_branch=False, out=None):
    """(primitive name, inside a cond branch) for every equation, sub-jaxprs included."""
    out = [] if out is None else out
    for eqn in jaxpr.eqns:
        out.append((eqn.primitive.name, in_branch))
        branch = in_branch or eqn.primitive.name == "cond"
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            _primitives(sub, branch, out)
    return out


def _outside_branches(fn, *args):
    found = _primitives(jax.make_jaxpr(fn)(*args).jaxpr)
    return {p for p, b in found if not b}, {p for p, b in found if b}


def _abstract_batch(B=4, K=3):
    sp = SamplingArrays(temperature=jnp.zeros((B,)), top_k=jnp.zeros((B,), jnp.int32),
                        top_p=jnp.ones((B,)), keys=jnp.zeros((B, 2), jnp.uint32))
    return sp, jnp.zeros((B, K + 1, V)), jnp.zeros((B, K), jnp.int32), jnp.zeros((B, K, V))


def test_jaxpr_keeps_sorts_softmax_and_draws_in_branches():
    sp, logits, drafts, q = _abstract_batch()
    B, K = drafts.shape
    outside, inside = _outside_branches(filtered_probs, logits, *_filters(sp))
    assert "sort" not in outside and "sort" in inside
    assert "exp" not in outside and "exp" in inside                   # the softmax
    outside, inside = _outside_branches(sample, logits[:, 0], sp, jnp.zeros((B,), jnp.int32))
    assert {"sort", "exp", "random_bits"}.isdisjoint(outside)
    assert {"sort", "exp", "random_bits"} <= inside
    outside, inside = _outside_branches(
        lambda *a: sample_from_probs(*a), q[:, 0], sp.keys, sp.temperature <= 0)
    assert "random_bits" not in outside and "random_bits" in inside
    spec = SpecConfig(num_speculative_tokens=K)
    outside, inside = _outside_branches(
        lambda *a: apply_acceptance(spec, *a), logits, drafts, q, jnp.full((B,), K, jnp.int32),
        jnp.zeros((B,), bool), sp, jnp.zeros((B,), jnp.int32))
    assert {"sort", "exp", "log"}.isdisjoint(outside)                 # softmax, categorical
    assert {"sort", "exp", "log"} <= inside


def _hlo_computations(text):
    """{computation name: body lines} of an HLO module's text, and the entry's name."""
    comps, entry, name = {}, None, None
    for line in text.splitlines():
        m = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if m and not line.startswith(" "):
            name = m.group(2)
            comps[name] = []
            if m.group(1):
                entry = name
        elif name is not None and line.strip() == "}":
            name = None
        elif name is not None:
            comps[name].append(line)
    return comps, entry


def test_compiled_hlo_sorts_only_inside_conditionals():
    """After XLA's passes (on this backend), no sort is reachable from the entry computation
    except through a conditional's branches."""
    sp, logits, _, _ = _abstract_batch()
    text = jax.jit(filtered_probs).lower(logits, *_filters(sp)).compile().as_text()
    comps, entry = _hlo_computations(text)
    assert entry is not None and any("conditional(" in line for line in comps[entry])
    called = re.compile(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
    seen, todo = set(), [entry]
    while todo:                                # reachable without entering a branch
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        for line in comps[c]:
            todo += called.findall(line)
    unconditional = [c for c in seen if any(" sort(" in line for line in comps[c])]
    assert not unconditional, f"sort outside a conditional in {unconditional}"
    assert any(" sort(" in line for body in comps.values() for line in body)
