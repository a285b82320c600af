"""LLM's text API on the shipped tiny model: chat messages in (the folder's template, encoded
without the tokenizer's own special tokens), text out, and stream text deltas that add up to
each output's text."""

import os

import numpy as np
import pytest

import mtpjax
from mtpjax.serve.chat_template import ChatTemplate, chat_encoder

MODEL = os.path.join(os.path.dirname(mtpjax.__file__), "assets", "tiny_code_mtp3")


@pytest.fixture(scope="module")
def llm():
    return mtpjax.LLM.from_pretrained(MODEL, mtpjax.SpecConfig(num_speculative_tokens=2),
                                      num_pages=64, page_size=8, max_num_seqs=4,
                                      max_num_batched_tokens=64, warmup=False)


def test_chat_prompts_use_the_folders_template_and_stream_text(llm):
    rng = np.random.default_rng(0)
    words = ["def", "add", "(a, b)", "return", "x", "é", "🙂", "for i in range(3):", "\n"]
    chats = [[{"role": "user", "content": " ".join(rng.choice(words, int(n)))}]
             for n in rng.integers(1, 6, 3)]
    chats[1] = [{"role": "system", "content": "be brief"}] + chats[1]
    sps = [mtpjax.SamplingParams(max_tokens=12),
           mtpjax.SamplingParams(max_tokens=9, temperature=0.9, seed=5),
           mtpjax.SamplingParams(max_tokens=7)]
    template, encode = ChatTemplate.from_folder(MODEL), chat_encoder(MODEL)
    expected_ids = [encode(template.render(c)) for c in chats]
    deltas = {i: "" for i in range(len(chats))}
    outs = [None] * len(chats)
    for ev in llm.generate_stream(chats, sps):
        deltas[ev.request_index] += ev.text_delta
        if ev.finished:
            outs[ev.request_index] = ev.output
    for i, out in enumerate(outs):
        assert out.prompt_token_ids == expected_ids[i]
        assert out.text == llm.tokenizer.decode(out.token_ids)
        assert deltas[i] == out.text, (deltas[i], out.text)
    # the same prompt as ids gives the same greedy tokens
    again = llm.generate([expected_ids[0]], sps[0])[0]
    assert again.token_ids == outs[0].token_ids


def test_bad_chat_messages_are_refused_by_position(llm):
    with pytest.raises(ValueError, match=r"prompt 1, message 0: expected"):
        llm.generate([[1, 2], [{"role": "user"}]])
    bare = mtpjax.LLM(llm.runner.params, llm.cfg, None, num_pages=8, page_size=8,
                      warmup=False, tokenizer=llm.tokenizer)
    with pytest.raises(ValueError, match="prompt 0 is a list of chat messages, but the LLM has "
                                         "no chat_template"):
        bare.generate([[{"role": "user", "content": "hi"}]])
    with pytest.raises(ValueError, match="chat_template must be"):
        mtpjax.LLM(llm.runner.params, llm.cfg, None, num_pages=8, chat_template=3, warmup=False)
