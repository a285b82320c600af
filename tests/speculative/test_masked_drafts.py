"""Drafts masked off by a row's k (per-request / adaptive K) are padding in the verify pass:
they route to no expert and write no KV, and the tokens are those of plain decoding."""

import jax
import pytest

import mtpjax
from mtpjax import SamplingParams, SpecConfig
import mtpjax.model.moe as moe
from tests.conftest import tiny_mla_moe_config


@pytest.mark.parametrize("seed,ks", [(0, (0, 1, 3)), (1, (2, 0, 1))])
def test_masked_drafts_route_nowhere_and_tokens_stay_plain(monkeypatch, seed, ks):
    K = 3
    # a vocabulary of its own per case: the step traces anew, so the spy below is in it
    cfg = tiny_mla_moe_config(61 + seed)
    params = mtpjax.init_params(cfg, jax.random.PRNGKey(seed), std=0.05)
    key = jax.random.PRNGKey(100 + seed)
    prompts = [list(map(int, jax.random.randint(jax.random.fold_in(key, i), (5 + 2 * i,), 1,
                                                cfg.vocab_size))) for i in range(3)]
    routed = []                                      # (tokens in the call, tokens routed)
    inner = moe.routed_experts

    def spy(p, x, ids, weights, valid, *a, **k):
        # ordered: the verify pass's call and the MTP module's are told apart by their order,
        # and XLA:CPU may run two unordered callbacks that depend on nothing in either order
        jax.debug.callback(lambda n, v: routed.append((int(n), int(v))),
                           valid.shape[0], valid.sum(), ordered=True)
        return inner(p, x, ids, weights, valid, *a, **k)

    monkeypatch.setattr(moe, "routed_experts", spy)
    sps = [SamplingParams(max_tokens=8, num_speculative_tokens=k) for k in ks]
    got = mtpjax.generate(params, cfg, prompts, max_new_tokens=8, sampling=sps,
                          spec=SpecConfig(num_speculative_tokens=K))
    monkeypatch.setattr(moe, "routed_experts", inner)
    want = mtpjax.generate(params, cfg, prompts, max_new_tokens=8)
    assert got.tokens == want.tokens
    # each step routes B x (K + 1) tokens twice: the verify pass's MoE layer, then the MTP
    # module's first draft pass over its window (W = K + 1 positions per row, all real)
    calls = [v for n, v in routed if n == len(prompts) * (K + 1)]
    verify = calls[0::2]
    assert verify, routed
    # every verify pass routes at most each row's pending token + its k drafts (finished rows
    # route nothing); the first, with no row finished, exactly that. Before, all K + 1 per
    # row were routed
    assert verify[0] == sum(k + 1 for k in ks)
    assert all(v <= sum(k + 1 for k in ks) for v in verify)
