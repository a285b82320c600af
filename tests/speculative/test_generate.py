"""Autoregressive generate: greedy == naive greedy over `forward`, batching invariance, errors."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtpjax
from mtpjax import SamplingParams
from tests.conftest import tiny_config


@functools.lru_cache(maxsize=None)
def _jit_forward(cfg):
    return jax.jit(lambda p, t: mtpjax.forward(p, cfg, t))


def naive_greedy(params, cfg, prompt, n, stop=()):
    """Greedy decoding by re-running the plain forward (right-padded to 64: causal, so inert)."""
    seq = list(prompt)
    out = []
    fwd = _jit_forward(cfg)
    for _ in range(n):
        padded = jnp.zeros((1, 64), jnp.int32).at[0, :len(seq)].set(jnp.asarray(seq))
        tok = int(jnp.argmax(fwd(params, padded)[0, len(seq) - 1]))
        out.append(tok)
        seq.append(tok)
        if tok in stop:
            break
    return out


def _params(cfg, seed):
    return mtpjax.init_params(cfg, jax.random.PRNGKey(seed), std=0.3)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_generate_matches_naive(seed):
    cfg = tiny_config()
    params = _params(cfg, seed)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, cfg.vocab_size, size=int(n)).tolist() for n in rng.integers(1, 10, 3)]
    out = mtpjax.generate(params, cfg, prompts, max_new_tokens=7, seed=seed,
                          page_size=int(rng.choice([2, 4, 16])))
    for p, o in zip(prompts, out.tokens):
        assert o == naive_greedy(params, cfg, p, 7)


@pytest.mark.parametrize("seed", [0, 1])
def test_batch_equals_each_prompt_alone(seed):
    cfg = tiny_config(model_type="qwen3", qk_norm=True)
    params = _params(cfg, seed)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, cfg.vocab_size, size=int(n)).tolist() for n in (3, 11, 1, 6)]
    for sampling in (SamplingParams(), SamplingParams(temperature=0.9, top_k=20, top_p=0.9)):
        # a request's key is fold_in(base, index) unless it has a seed: give each its own seed
        sps = [dataclasses.replace(sampling, seed=1000 + j) for j in range(len(prompts))]
        batched = mtpjax.generate(params, cfg, prompts, max_new_tokens=8, sampling=sps, seed=seed)
        for i, p in enumerate(prompts):
            alone = mtpjax.generate(params, cfg, [p], max_new_tokens=8, sampling=[sps[i]],
                                    seed=seed)
            assert batched.tokens[i] == alone.tokens[0]
        if sampling.temperature == 0:
            for p, o in zip(prompts, batched.tokens):
                assert o == naive_greedy(params, cfg, p, 8)


def test_stop_tokens_and_per_request_max_tokens():
    cfg = tiny_config()
    params = _params(cfg, 4)
    prompts = [[1, 2, 3], [4, 5]]
    free = mtpjax.generate(params, cfg, prompts, max_new_tokens=10)
    stop = free.tokens[0][3]
    sps = [SamplingParams(stop_token_ids=(stop,)), SamplingParams(max_tokens=4)]
    out = mtpjax.generate(params, cfg, prompts, max_new_tokens=10, sampling=sps)
    first = free.tokens[0].index(stop)
    assert out.tokens[0] == free.tokens[0][: first + 1]
    assert out.tokens[1] == free.tokens[1][:4]


def test_sampling_is_reproducible_and_seeded():
    cfg = tiny_config()
    params = _params(cfg, 5)
    sp = SamplingParams(temperature=1.0)
    a = mtpjax.generate(params, cfg, [[1, 2]] * 4, max_new_tokens=12, sampling=sp, seed=3)
    b = mtpjax.generate(params, cfg, [[1, 2]] * 4, max_new_tokens=12, sampling=sp, seed=3)
    assert a.tokens == b.tokens
    assert len({tuple(t) for t in a.tokens}) > 1          # per-request keys differ


def test_bad_inputs():
    cfg = tiny_config()
    params = _params(cfg, 0)
    with pytest.raises(ValueError, match="empty"):
        mtpjax.generate(params, cfg, [[1], []], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"token id 96 outside"):
        mtpjax.generate(params, cfg, [[1, 96]], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"token id -1 outside"):
        mtpjax.generate(params, cfg, [[-1]], max_new_tokens=2)
    with pytest.raises(ValueError, match="num_pages=2"):
        mtpjax.generate(params, cfg, [[1, 2, 3]], max_new_tokens=40, page_size=4, num_pages=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        mtpjax.generate(params, cfg, [[1]], max_new_tokens=0)
    with pytest.raises(ValueError, match="non-empty list"):
        mtpjax.generate(params, cfg, [], max_new_tokens=2)
    with pytest.raises(ValueError, match="2 SamplingParams for 1"):
        mtpjax.generate(params, cfg, [[1]], max_new_tokens=2, sampling=[SamplingParams()] * 2)


@pytest.mark.parametrize("seed", [0, 1])
def test_steps_per_check_changes_nothing(seed):
    """The on-device loop checks "all done" every steps_per_check steps; the steps it runs after
    the last request finished (padding rows only) change neither tokens nor statistics."""
    cfg = tiny_config()
    params = _params(cfg, seed)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, cfg.vocab_size, size=int(n)).tolist() for n in (2, 5, 3)]
    free = mtpjax.generate(params, cfg, prompts, max_new_tokens=9)
    # stop tokens and per-request limits finish requests at different steps
    sps = [SamplingParams(stop_token_ids=(free.tokens[0][4],)), SamplingParams(max_tokens=3),
           SamplingParams(temperature=0.8, seed=seed)]
    for spec in (None, mtpjax.SpecConfig(num_speculative_tokens=2)):
        outs = [mtpjax.generate(params, cfg, prompts, max_new_tokens=9, sampling=sps, spec=spec,
                                steps_per_check=n,
                                draft_source="random" if spec else "model")   # partial acceptance
                for n in (1, 3, 8)]
        for o in outs[1:]:
            assert o.tokens == outs[0].tokens
            assert o.stats == outs[0].stats
    with pytest.raises(ValueError, match="steps_per_check must be a positive int, got 0"):
        mtpjax.generate(params, cfg, prompts, max_new_tokens=2, steps_per_check=0)
