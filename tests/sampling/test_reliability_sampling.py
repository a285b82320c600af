"""Sampling and request handling that must not fail silently: a tiny top_p keeps the top token
(LLM and generate), `mtpjax.generate` checks SamplingParams exactly as `LLM` does (one shared
validator) and honours or refuses every field, engine errors name the prompt's position,
aborting a finished request says so, `DataParallelLLM.abort` takes the ids its stream events
carry, and NaN weights are warned about.

Compiles are the cost here: one plain engine (greedy and sampled steps), one speculative
`generate` program (sampled, per-request K) shared by two tests through a module fixture, and
one small data-parallel engine; every error test fails before anything compiles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtpjax
from mtpjax import SamplingParams as SP
from mtpjax.sampling import TOP_P_MIN, SamplingArrays, filtered_probs

CFG = mtpjax.ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, num_mtp_layers=1)
PARAMS = mtpjax.init_params(CFG, jax.random.PRNGKey(0))
SPEC = mtpjax.SpecConfig(num_speculative_tokens=2)
PROMPTS = [[5, 6, 7], [1, 2]]
NEW = 8
# top_p values SamplingParams accepts that are 0 (or subnormal, flushed to 0) in float32
TINY_P = (1e-40, 1e-46, 1e-300)


@pytest.fixture(scope="module")
def llm():
    """A plain engine: its greedy and sampled steps compile once for the module."""
    return mtpjax.LLM(PARAMS, CFG, None, num_pages=64, page_size=8, max_num_seqs=4,
                      max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def greedy(llm):
    return [o.token_ids for o in llm.generate(PROMPTS, SP(max_tokens=NEW))]


# generate's one compiled program here: sampled rows with tiny top_p, each verifying k = 1 of
# the K = 2 drafts
GEN_SAMPLING = [SP(temperature=1.0, top_p=1e-300, seed=1, num_speculative_tokens=1),
                SP(temperature=1.0, top_p=1e-46, seed=2, num_speculative_tokens=1)]


@pytest.fixture(scope="module")
def gen_out():
    return mtpjax.generate(PARAMS, CFG, PROMPTS, max_new_tokens=NEW, spec=SPEC,
                           sampling=GEN_SAMPLING)


# ---- top_p below the smallest float32 keeps the top token -----------------------------------

@pytest.mark.parametrize("p", [0.0, 1e-45, -1.0, float("nan")])
def test_top_p_mask_keeps_the_top_token_for_any_float(p):
    """On the device the nucleus holds the top token whatever float top_p reaches it (0 from an
    underflow, a flushed subnormal, garbage): the distribution is one-hot on the argmax."""
    logits = jax.random.normal(jax.random.PRNGKey(3), (3, 32))
    probs = filtered_probs(logits, jnp.ones(3), jnp.zeros(3, jnp.int32), jnp.full(3, p))
    want = jax.nn.one_hot(jnp.argmax(logits, -1), 32)
    np.testing.assert_allclose(np.asarray(probs), np.asarray(want), rtol=0, atol=1e-6)


def test_top_p_host_conversion_stays_positive():
    arrays = SamplingArrays.build([SP(temperature=1.0, top_p=p) for p in TINY_P + (0.5, 1.0)])
    top_p = np.asarray(arrays.top_p)
    assert (top_p[:3] == np.float32(TOP_P_MIN)).all() and top_p[3] == 0.5 and top_p[4] == 1.0


def test_tiny_top_p_gives_the_greedy_tokens_in_llm(llm, greedy):
    prompts, sps, want = [], [], []
    for p in TINY_P:
        for seed in (1, 2):
            for i, prompt in enumerate(PROMPTS):
                prompts.append(prompt)
                sps.append(SP(temperature=1.0, top_p=p, seed=seed, max_tokens=NEW))
                want.append(greedy[i])
    assert [o.token_ids for o in llm.generate(prompts, sps)] == want


def test_tiny_top_p_gives_the_greedy_tokens_in_generate(gen_out, greedy):
    """Speculative generate (rejection sampling of sampled rows): a one-token nucleus in target
    and draft makes every committed token the argmax, as greedy decoding's."""
    assert gen_out.tokens == greedy


# ---- generate validates SamplingParams as LLM does, and honours or refuses each field -------

def test_generate_honours_per_request_num_speculative_tokens(gen_out):
    """k = 1 of K = 2: each verify step proposes one draft per request (it proposed K before)."""
    stats = gen_out.stats
    assert stats["verify_steps"] > 0
    assert stats["proposed_draft_tokens"] == stats["verify_steps"]
    assert stats["accepted_draft_tokens"] <= stats["proposed_draft_tokens"]


GEN = dict(max_new_tokens=4, spec=SPEC)


@pytest.mark.parametrize("bad, match", [
    (SP(num_speculative_tokens=5),
     r"sampling\[1\]: num_speculative_tokens=5 exceeds mtpjax.generate's K=2"),
    (SP(logprobs=3), r"sampling\[1\]: logprobs=3, but mtpjax.generate returns no logprobs.*"
                     r"mtpjax.LLM\(\.\.\., max_logprobs=3\)"),
    (SP(logprobs=0), r"sampling\[1\]: logprobs=0, but mtpjax.generate returns no logprobs"),
    (SP(prompt_logprobs=2), r"sampling\[1\]: prompt_logprobs=2, but mtpjax.generate returns "
                            r"no logprobs.*mtpjax.LLM"),
    (SP(stop_token_ids=[3, 256]), r"sampling\[1\]: stop_token_ids has 256, outside the "
                                  r"vocabulary \[0, 256\)"),
])
def test_generate_refuses_what_it_cannot_serve_naming_position_and_field(bad, match):
    with pytest.raises(ValueError, match=match):
        mtpjax.generate(PARAMS, CFG, PROMPTS, sampling=[SP(), bad], **GEN)


def test_generate_and_llm_share_one_validator():
    """The same request is refused by both, with the same field and position named."""
    llm = mtpjax.LLM(PARAMS, CFG, SPEC, num_pages=16, page_size=8, max_num_seqs=2)
    for bad, match in ((SP(num_speculative_tokens=3), r"\[1\]: num_speculative_tokens=3 exceeds"),
                       (SP(stop_token_ids=[10 ** 6]), r"\[1\]: stop_token_ids has 1000000")):
        with pytest.raises(ValueError, match="sampling" + match):
            mtpjax.generate(PARAMS, CFG, PROMPTS, sampling=[SP(), bad], **GEN)
        with pytest.raises(ValueError, match="sampling_params" + match):
            llm.generate(PROMPTS, [SP(), bad])
    # one SamplingParams for every prompt: named without an index
    with pytest.raises(ValueError, match=r"^sampling: num_speculative_tokens=1 exceeds "
                                         r"mtpjax.generate's K=0 \(mtpjax.generate without spec"):
        mtpjax.generate(PARAMS, CFG, PROMPTS, max_new_tokens=4,
                        sampling=SP(num_speculative_tokens=1))
    # an engine built without logprobs cannot return logprobs=0 (it returned [] before)
    with pytest.raises(ValueError, match=r"logprobs=0 needs an engine built with max_logprobs"):
        llm.generate(PROMPTS, SP(logprobs=0))
    assert not llm._requests and llm._next_id == 0


@pytest.mark.parametrize("seed", [-1, 2 ** 32, 1.5])
def test_generate_names_a_bad_seed(seed):
    with pytest.raises(ValueError, match=rf"seed must be an int in \[0, 2\*\*32\).*"
                                         rf"seed={seed!r}"):
        mtpjax.generate(PARAMS, CFG, PROMPTS, max_new_tokens=2, seed=seed)


# ---- engine errors name what the caller knows -----------------------------------------------

def test_can_never_be_served_names_the_prompt_position(llm):
    next_id = llm._next_id
    with pytest.raises(ValueError, match=r"^prompt 1 can never be served: prompt of 600 tokens"):
        llm.generate([[1, 2], [1] * 600], SP(max_tokens=10))
    with pytest.raises(ValueError, match=r"^the request can never be served"):
        llm.add_request([1] * 600, SP(max_tokens=10))
    assert llm._next_id == next_id and not llm._requests


def test_aborting_a_finished_request_says_finished_not_unknown(llm):
    out = llm.generate([[5, 6, 7]], SP(max_tokens=2))[0]
    with pytest.raises(ValueError, match=rf"cannot abort request {out.request_id}: already "
                                         r"finished, and its final output was handed over"):
        llm.abort(out.request_id)
    seq = llm.add_request([5, 6, 7], SP(max_tokens=2))
    while not seq.is_finished:
        llm.step()
    llm.flush()
    with pytest.raises(ValueError, match="already finished"):
        llm.abort(seq.seq_id)
    with pytest.raises(ValueError, match=r"cannot abort request 10000: unknown"):
        llm.abort(10000)
    assert not llm._requests


# ---- DataParallelLLM.abort takes the ids its stream events carry ----------------------------

def test_data_parallel_abort_takes_the_ids_stream_events_carry():
    cfg = mtpjax.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                             num_heads=2, num_kv_heads=1)
    params = mtpjax.init_params(cfg, jax.random.PRNGKey(1))
    dev = jax.devices()[0]
    dp = mtpjax.DataParallelLLM(params, cfg, data_parallel=2, devices=[dev, dev], num_pages=32,
                                page_size=4, max_num_seqs=2, max_num_batched_tokens=32)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8], [9]]
    stream = dp.generate_stream(prompts, SP(max_tokens=12))
    first = next(stream)
    ids = {first.request_index: first.request_id}
    out = dp.abort(first.request_id)
    assert out.finish_reason == "abort" and out.request_id == first.request_id
    final = {}
    for ev in stream:
        ids.setdefault(ev.request_index, ev.request_id)
        if ev.finished:
            final[ev.request_index] = ev.output
    assert final[first.request_index].finish_reason == "abort"
    assert all(final[i].finish_reason == "length" for i in range(4) if i != first.request_index)
    assert len(set(ids.values())) == 4                  # unique across replicas
    assert all(final[i].request_id == ids[i] for i in range(4))
    with pytest.raises(ValueError, match=rf"cannot abort request {first.request_id} .*already "
                                         r"finished"):
        dp.abort(first.request_id)
    with pytest.raises(ValueError, match="abort takes a Sequence"):
        dp.abort("0")


# ---- NaN weights are warned about, once, naming the leaf ------------------------------------

def _nan_params():
    """PARAMS with one NaN in layer 1's w_up (a tuple of per-layer dicts)."""
    layers = [dict(layer) for layer in PARAMS["layers"]]
    layers[1]["w_up"] = layers[1]["w_up"].at[0, 0].set(jnp.nan)
    return {**PARAMS, "layers": tuple(layers)}, "layers/1/w_up"


def test_nan_weights_are_warned_about_naming_the_leaf(gen_out):
    import warnings

    from mtpjax.generate import NonFiniteParamsWarning
    bad, leaf = _nan_params()
    with pytest.warns(NonFiniteParamsWarning, match=rf"mtpjax.LLM: params leaf '{leaf}' holds "
                                                    r"NaN or inf"):
        mtpjax.LLM(bad, CFG, SPEC, num_pages=16, page_size=8, max_num_seqs=2)
    with pytest.warns(NonFiniteParamsWarning, match=rf"mtpjax.generate: params leaf '{leaf}'"):
        mtpjax.generate(bad, CFG, PROMPTS, max_new_tokens=NEW, spec=SPEC, sampling=GEN_SAMPLING)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NonFiniteParamsWarning)
        mtpjax.LLM(PARAMS, CFG, SPEC, num_pages=16, page_size=8, max_num_seqs=2)
