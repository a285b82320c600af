"""The serving text layer without a server: incremental detokenization, stop strings, chat
templates, request checking and the metrics text (mtpjax/serve/)."""

import json
import os

import numpy as np
import pytest

from mtpjax.checkpoint.bundle import Tokenizer
from mtpjax.serve import DEFAULT_CHAT_TEMPLATE, ChatTemplate, ChatTemplateError
from mtpjax.serve.chat_template import chat_encoder
from mtpjax.serve import IncrementalDetokenizer, StopStrings
from mtpjax.serve.metrics import ServerMetrics
from mtpjax.serve.protocol import RequestError, ServeContext, parse_chat, parse_completion

ASSETS = os.path.join(os.path.dirname(__file__), "..", "..", "mtpjax", "assets")
MTP3 = os.path.join(ASSETS, "tiny_code_mtp3")
TEXTS = ["héllo wörld 😀 naïve — ok", "print('日本語')\n", "x = 1  # ∑ ∫ 🚀🚀", "plain ascii\n"]


@pytest.fixture(scope="module")
def tok():
    with open(os.path.join(MTP3, "tokenizer.json")) as f:
        return Tokenizer(f.read())


def _stream(tok, ids, chunks, prompt=()):
    d = IncrementalDetokenizer(tok.decode, prompt)
    deltas, i = [], 0
    for n in chunks:
        deltas.append(d.push(ids[i:i + n]))
        i += n
    deltas.append(d.push(ids[i:]))
    deltas.append(d.finish())
    return deltas, d


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_text_streams_whole_characters(tok, text):
    """One token at a time: a character split over several byte-level tokens is held back until
    complete (no U+FFFD ever leaves), and the deltas concatenate to the text."""
    ids = tok.encode(text)
    assert len(ids) > len(text.encode("utf-8")) // 4       # really split into small pieces
    deltas, d = _stream(tok, ids, [1] * len(ids), prompt=tok.encode("# prompt\n"))
    assert "".join(deltas) == tok.decode(ids) == d.text
    assert not any("\ufffd" in x for x in deltas)
    assert d.token_ids == ids


def test_random_ids_and_chunks_concatenate_to_the_whole_decode(tok):
    """Arbitrary token ids (invalid UTF-8 byte runs included) pushed in random chunk sizes, as
    a speculative step commits 1..K+1 tokens: deltas always concatenate to decode(all)."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        ids = rng.integers(1, 768, size=int(rng.integers(1, 40))).tolist()
        chunks = rng.integers(1, 5, size=len(ids)).tolist()
        prompt = rng.integers(1, 768, size=int(rng.integers(0, 10))).tolist()
        deltas, _ = _stream(tok, ids, chunks, prompt)
        assert "".join(deltas) == tok.decode(ids)


def test_window_keeps_a_leading_space_the_decoder_strips():
    """A SentencePiece-like decode drops the text's leading space; the prompt context decoded
    ahead of the completion keeps the first completion token's space."""
    vocab = {0: " hello", 1: " world", 2: "!"}
    decode = lambda ids: "".join(vocab[i] for i in ids).lstrip(" ")     # noqa: E731
    d = IncrementalDetokenizer(decode, prompt_ids=[0])
    assert d.push([1]) + d.push([2]) + d.finish() == " world!"
    assert IncrementalDetokenizer(decode).push([1]) == "world"          # no context: stripped


def test_push_after_finish_is_an_error(tok):
    d = IncrementalDetokenizer(tok.decode)
    d.finish()
    assert d.finish() == ""
    with pytest.raises(RuntimeError, match="push after finish"):
        d.push([5])


def test_stop_strings_across_deltas():
    s = StopStrings(["END", "\n\n"])
    out = []
    for delta in ["abc E", "N", "xyz EN", "D more"]:
        text, stopped = s.feed(delta)
        out.append(text)
    assert "".join(out) == "abc ENxyz " and stopped
    assert s.flush() == "" and s.feed("late") == ("", True)
    s = StopStrings(["STOP"])
    out = [s.feed(x)[0] for x in ["a", "ST", "O"]]
    # the last len("STOP") - 1 characters may start a stop string: held back, then flushed
    assert out == ["", "", "a"] and s.flush() == "STO"
    assert StopStrings([]).feed("x\n") == ("x\n", False)


def test_shipped_chat_template_renders_as_transformers_does():
    transformers = pytest.importorskip("transformers")
    messages = [{"role": "system", "content": "be brief\nand exact"},
                {"role": "user", "content": "read a file"},
                {"role": "assistant", "content": "open(p).read()"},
                {"role": "user", "content": "now write it"}]
    ours = ChatTemplate.from_folder(MTP3)
    assert "tokenizer_config.json" in ours.origin
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(MTP3)
    for gen in (True, False):
        assert ours.render(messages, add_generation_prompt=gen) == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen)


def test_template_sources(tmp_path):
    # no template anywhere: the documented default
    t = ChatTemplate.from_folder(os.path.join(ASSETS, "tiny_code_mimo"))
    assert t.source == DEFAULT_CHAT_TEMPLATE and "default" in t.origin
    assert t.render([{"role": "user", "content": "hi"}]) == "user: hi\n\nassistant: "
    # a named list: "default" is used; special tokens are variables
    cfg = {"eos_token": {"content": "</s>"}, "chat_template": [
        {"name": "tool_use", "template": "T"},
        {"name": "default", "template": "{{ messages[0]['content'] }}{{ eos_token }}"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = ChatTemplate.from_folder(str(tmp_path))
    assert t.render([{"role": "u", "content": "x"}]) == "x</s>"
    # chat_template.jinja wins over tokenizer_config.json, as in transformers
    (tmp_path / "chat_template.jinja").write_text("J{{ messages|length }}{{ 'é'|tojson }}")
    assert ChatTemplate.from_folder(str(tmp_path)).render([{}, {}]) == 'J2"é"'


def test_template_errors_name_the_template(tmp_path):
    t = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}"
                     "{% endif %}ok", origin="T.jinja")
    assert t.render([{"role": "user", "content": ""}]) == "ok"
    with pytest.raises(ChatTemplateError, match="T.jinja.*user first"):
        t.render([{"role": "system", "content": ""}])
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% for %}", origin="bad")
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": [{"name": "x"}]}')
    with pytest.raises(ChatTemplateError, match="without a 'default'"):
        ChatTemplate.from_folder(str(tmp_path))


def test_chat_prompts_skip_the_tokenizers_own_special_tokens(tmp_path, tok):
    """A tokenizer.json whose post-processor prepends BOS (as Llama's does): completion prompts
    get it, a rendered chat does not (its template writes BOS itself), as in transformers."""
    with open(os.path.join(MTP3, "tokenizer.json")) as f:
        spec = json.load(f)
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0],
                                             "tokens": ["<|endoftext|>"]}}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with_bos = Tokenizer((tmp_path / "tokenizer.json").read_text())
    assert with_bos.encode("x = 1")[0] == 0
    encode_chat = chat_encoder(str(tmp_path), with_bos.encode)
    assert encode_chat("x = 1") == tok.encode("x = 1") and encode_chat("x = 1")[0] != 0
    assert chat_encoder(os.path.join(ASSETS, "nowhere"), tok.encode) == tok.encode


def _ctx(tok, K=3):
    return ServeContext(model_name="m", vocab_size=768, num_speculative_tokens=K,
                        acceptance="rejection" if K else None,
                        max_completion_tokens=lambda n: 256 - n, encode=tok.encode,
                        chat_template=ChatTemplate.from_folder(MTP3))


@pytest.mark.parametrize("body, param, words", [
    ({"max_tokens": 0}, "max_tokens", "max_tokens=0"),
    ({"max_tokens": 1000}, "max_tokens", "max_tokens=1000 is too large"),
    ({"temperature": 3}, "temperature", "temperature=3"),
    ({"top_p": 0}, "top_p", "top_p=0"),
    ({"n": 2}, "n", "n=2"),
    ({"stop": [1]}, "stop", "stop="),
    ({"num_speculative_tokens": 4}, "num_speculative_tokens", "[0, 3]"),
    ({"acceptance": "greedy"}, "acceptance", "'greedy' differs"),
    ({"num_speculative_token": 1}, "num_speculative_token", "unknown field"),
    ({"prompt": []}, "prompt", "prompt="),
    ({"prompt": [5, 768]}, "prompt", "token id 768"),
    ({"prompt": "x" * 2000}, "prompt", "too long"),
    ({"logprobs": 2}, "logprobs", "not supported"),
    ({"seed": "1"}, "seed", "seed='1'"),
])
def test_bad_completion_fields_are_named(tok, body, param, words):
    full = {"model": "m", "prompt": "def f():\n", **body}
    with pytest.raises(RequestError) as e:
        parse_completion(full, _ctx(tok))
    assert e.value.status == 400 and e.value.param == param and words in e.value.message


def test_requests_parse_to_engine_requests(tok):
    g = parse_completion({"model": "m", "prompt": ["x = 1\n"], "temperature": 0, "stop": "\n",
                          "num_speculative_tokens": 0, "acceptance": "rejection"}, _ctx(tok))
    assert g.prompt_ids == tok.encode("x = 1\n") and g.stop == ("\n",)
    sp = g.sampling_params
    assert sp.greedy and sp.max_tokens == 16 and sp.num_speculative_tokens == 0
    g = parse_chat({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}]}], "max_completion_tokens": 5}, _ctx(tok))
    assert g.prompt_ids == tok.encode("# user: hi\n") and g.sampling_params.max_tokens == 5
    assert parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                      _ctx(tok)).sampling_params.max_tokens == 256 - len(g.prompt_ids)
    with pytest.raises(RequestError) as e:
        parse_chat({"model": "m", "messages": [{"role": "user"}]}, _ctx(tok))
    assert e.value.param == "messages" and "messages[0].content" in e.value.message
    with pytest.raises(RequestError) as e:
        parse_completion({"model": "other", "prompt": "x"}, _ctx(tok))
    assert e.value.status == 404 and e.value.param == "model"
    with pytest.raises(RequestError) as e:
        parse_completion({"model": "m", "prompt": "x", "num_speculative_tokens": 1},
                         _ctx(tok, K=0))
    assert e.value.param == "num_speculative_tokens" and "without MTP" in e.value.message


def test_metrics_render_per_position_acceptance():
    m = ServerMetrics(3)
    m.step(0.01, 7, [(1, 3, 2), (1, 3, 0), (1, 2, 2)])   # (verify steps, proposed, kept)
    m.set_queues(2, 5, 7)
    text = m.render()
    assert 'mtpjax_spec_position_proposed_total{position="3"} 2' in text
    assert 'mtpjax_spec_position_accepted_total{position="1"} 2' in text
    assert 'mtpjax_spec_position_acceptance{position="2"} 0.666667' in text
    assert "mtpjax_requests_waiting 5" in text and "mtpjax_generation_tokens_total 7" in text
    assert "mtpjax_spec_acceptance_rate 0.500000" in text
    assert "spec_" not in ServerMetrics(0).render()
