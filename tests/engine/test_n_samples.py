"""SamplingParams(n=k) in mtpjax.LLM.generate / generate_stream, on the shipped tiny model: k
outputs per prompt in sample order, sample j seeded with seed + j, the prompt's KV prefilled
once and shared through the prefix cache, n = 1 callers unchanged. A plain engine (spec=None):
the expansion is host code that does not depend on speculation, and a plain engine's steps
compile in a fraction of the time."""

import os

import pytest

import mtpjax
from mtpjax.sampling import validate_sampling_params

MODEL = os.path.join(os.path.dirname(mtpjax.__file__), "assets", "tiny_code_mtp3")
SP = mtpjax.SamplingParams
PAGE = 8


@pytest.fixture(scope="module")
def llm():
    return mtpjax.LLM.from_pretrained(MODEL, None, num_pages=64, page_size=PAGE, max_num_seqs=4,
                                      max_num_batched_tokens=64, warmup=False)


def _prompt(llm, text):
    return llm.tokenizer.encode(text)[:20]          # 2 full blocks of 8, then 4 tokens


def test_greedy_n_gives_equal_samples_and_shares_the_prompt_blocks(llm):
    a = _prompt(llm, "def fibonacci(n):\n    if n < 2:\n        return n\n    return fib")
    b = _prompt(llm, "import collections\nimport functools\nimport itertools\nimport os\n")
    assert len(a) == len(b) == 20
    hits = llm.block_manager.num_prefix_hit_blocks
    outs = llm.generate([a, b], [SP(max_tokens=12, n=3), SP(max_tokens=12)])
    # the 2 later samples of `a` each reuse its 2 full prompt blocks; nothing else was cached
    assert llm.block_manager.num_prefix_hit_blocks - hits == 2 * (20 // PAGE)
    assert [o.sample_index for o in outs] == [0, 1, 2, 0]
    assert [o.prompt_token_ids for o in outs] == [a, a, a, b]
    ref = llm.generate([a, b], SP(max_tokens=12))         # n = 1: one output per prompt
    assert len(ref) == 2
    for o in outs[:3]:
        assert (o.token_ids, o.text, o.finish_reason) == \
            (ref[0].token_ids, ref[0].text, ref[0].finish_reason)
    assert outs[3].token_ids == ref[1].token_ids
    assert len({o.request_id for o in outs}) == 4


def test_seeded_samples_are_seed_plus_j_and_stream(llm):
    p = _prompt(llm, "class Stack:\n    def __init__(self):\n        self.items = []\n    def")
    sp = SP(max_tokens=16, temperature=1.0, seed=2**32 - 2, n=3)
    deltas, outs = {}, {}
    for ev in llm.generate_stream([[1, 2, 3], p], [SP(max_tokens=4), sp]):
        key = (ev.request_index, ev.sample_index)
        deltas[key] = deltas.get(key, "") + ev.text_delta
        if ev.finished:
            outs[key] = ev.output
    assert sorted(outs) == [(0, 0), (1, 0), (1, 1), (1, 2)]
    for key, o in outs.items():
        assert deltas[key] == o.text and o.sample_index == key[1]
    # sample j is the request with seed (seed + j) mod 2**32, as vLLM derives them
    seeds = [2**32 - 2, 2**32 - 1, 0]
    singles = llm.generate([p] * 3, [SP(max_tokens=16, temperature=1.0, seed=s) for s in seeds])
    for j, s in enumerate(singles):
        assert outs[(1, j)].token_ids == s.token_ids
    assert len({tuple(outs[(1, j)].token_ids) for j in range(3)}) > 1


def test_n_refusals(llm):
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        SP(n=0)
    with pytest.raises(ValueError, match=r"sampling_params: n=2 \(prompt 0\).*LLM.generate"):
        llm.add_request([1, 2, 3], SP(n=2))
    with pytest.raises(ValueError, match=r"sampling_params\[0\]: n=2, but mtpjax.generate"):
        validate_sampling_params([SP(n=2)], 1, vocab_size=8, num_speculative_tokens=0,
                                 max_logprobs=0, caller="generate")
    assert not llm._requests                          # nothing was queued
