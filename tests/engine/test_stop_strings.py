"""Stop strings (`SamplingParams(stop=..., include_stop_str_in_output=...)`) in mtpjax.LLM, on the
shipped tiny model with its tokenizer: a request ends at the first token whose text completes a
stop string (that token is kept, as vLLM keeps it), its text is cut exactly at the stop string,
the same with speculation as without, and streamed deltas never show text past the cut."""

import json
import os

import numpy as np
import pytest

import mtpjax
from mtpjax.sampling import validate_sampling_params
from mtpjax.serve.stop_strings import StopStrings

MODEL = os.path.join(os.path.dirname(mtpjax.__file__), "assets", "tiny_code_mtp3")
SP = mtpjax.SamplingParams
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def engines():
    kw = dict(num_pages=64, page_size=8, max_num_seqs=4, max_num_batched_tokens=64,
              warmup=False)
    spec = mtpjax.LLM.from_pretrained(MODEL, mtpjax.SpecConfig(num_speculative_tokens=2), **kw)
    plain = mtpjax.LLM.from_pretrained(MODEL, None, **kw)
    with open(os.path.join(MODEL, "prompts.json")) as f:
        # 8 token ids each: few step shapes to compile
        prompts = [spec.tokenizer.encode(p["text"])[-8:] for p in json.load(f)[:4]]
    full = plain.generate(prompts, SP(max_tokens=MAX_TOKENS))
    return spec, plain, prompts, full


def _oracle(tokenizer, token_ids, stops, include=False):
    """What plain decoding must give: the first token after which the completion's text contains
    a stop string ends it (kept); the text is cut at the earliest stop string in that text."""
    for j in range(len(token_ids)):
        text = tokenizer.decode(token_ids[:j + 1])
        hits = [(text.find(s), k) for k, s in enumerate(stops) if s in text]
        if hits:
            i, k = min(hits)
            return token_ids[:j + 1], text[:i + (len(stops[k]) if include else 0)], stops[k]
    return token_ids, tokenizer.decode(token_ids), None


def _stop_cases(tokenizer, full, rng):
    """Stop strings taken from the plain completions: inside one token, ending inside a token,
    spanning several tokens; plus one that never occurs."""
    cases = []
    for out in full:
        pieces = [tokenizer.decode([t]) for t in out.token_ids]
        ends = np.cumsum([len(p) for p in pieces])
        text = out.text
        assert "".join(pieces) == text        # ASCII code: token texts concatenate
        j = int(rng.integers(2, len(pieces) - 4))
        start = int(ends[j - 1])
        multi = text[start:int(ends[j + 2])]                          # spans 3 tokens
        mid = text[start:int(ends[j + 1]) - 1] if len(pieces[j + 1]) > 1 else text[start:start + 1]
        a = int(rng.integers(0, len(text) - 3))
        rand = text[a:a + int(rng.integers(1, 4))]                    # anywhere, 1..3 chars
        cases += [(out.request_id, [multi]), (out.request_id, [mid]), (out.request_id, [rand]),
                  (out.request_id, [mid, rand, "\x00never"])]
    return cases


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_stop_strings_match_plain_decoding(engines, seed):
    spec, plain, prompts, full = engines
    tok = spec.tokenizer
    rng = np.random.default_rng(seed)
    cases = _stop_cases(tok, full, rng)
    include = [bool(rng.integers(2)) for _ in cases]
    ids = {o.request_id: i for i, o in enumerate(full)}
    ps = [prompts[ids[rid]] for rid, _ in cases]
    sps = [SP(max_tokens=MAX_TOKENS, stop=stops, include_stop_str_in_output=inc)
           for (_, stops), inc in zip(cases, include)]
    # 4 requests per call (the batch size): no prefill joins running decodes, so fewer step
    # shapes to compile
    got_plain, got_spec, deltas = [], [None] * len(cases), [""] * len(cases)
    for lo in range(0, len(cases), 4):
        got_plain += plain.generate(ps[lo:lo + 4], sps[lo:lo + 4])
        for ev in spec.generate_stream(ps[lo:lo + 4], sps[lo:lo + 4]):
            deltas[lo + ev.request_index] += ev.text_delta
            if ev.finished:
                got_spec[lo + ev.request_index] = ev.output
    for (rid, stops), inc, a, b, d in zip(cases, include, got_spec, got_plain, deltas):
        want_ids, want_text, want_stop = _oracle(tok, full[ids[rid]].token_ids, stops, inc)
        assert b.token_ids == want_ids and b.text == want_text, (stops, inc)
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == \
            (b.token_ids, b.text, b.finish_reason, b.stop_reason), (stops, inc)
        assert a.stop_reason == want_stop
        assert a.finish_reason == ("stop" if want_stop is not None else "length")
        assert d == a.text
        if want_stop is not None:
            assert (want_stop in d) == inc and (d.endswith(want_stop) if inc else True)
            assert want_text == full[ids[rid]].text[:len(want_text)]


def test_stream_never_emits_past_the_cut(engines):
    spec, _, prompts, full = engines
    tok = spec.tokenizer
    out = full[0]
    pieces = [tok.decode([t]) for t in out.token_ids]
    j = len(pieces) // 2
    stop = "".join(pieces[j:j + 3])                 # completed by the 3rd of those tokens
    want_ids, want_text, _ = _oracle(tok, out.token_ids, [stop])
    streamed = ""
    for ev in spec.generate_stream([prompts[0]], SP(max_tokens=MAX_TOKENS, stop=stop)):
        streamed += ev.text_delta
        assert want_text.startswith(streamed) and stop not in streamed
    assert streamed == want_text and ev.output.token_ids == want_ids


def test_seeded_sampling_with_stop_is_the_unstopped_run_cut(engines):
    """A stop string only ends a request: its tokens up to the cut are those it samples
    without the stop string (same seed). On the plain engine: speculation's sampled step costs
    ~10 s more to compile, and the cut is the same host code (the greedy test covers it)."""
    _, plain, prompts, _ = engines
    tok = plain.tokenizer
    # one request at a time: few sampled step shapes to compile
    free = [plain.generate([prompts[0]], SP(max_tokens=MAX_TOKENS, temperature=0.8, seed=s))[0]
            for s in (3, 4)]
    rng = np.random.default_rng(5)
    stops = []
    for o in free:
        a = int(rng.integers(len(o.text) // 3, len(o.text) - 3))
        stops.append(o.text[a:a + 3])
    got = [plain.generate([prompts[0]], SP(max_tokens=MAX_TOKENS, temperature=0.8, seed=s,
                                          stop=[st]))[0] for s, st in zip((3, 4), stops)]
    for o, g, st in zip(free, got, stops):
        want_ids, want_text, want_stop = _oracle(tok, o.token_ids, [st])
        assert (g.token_ids, g.text, g.stop_reason) == (want_ids, want_text, want_stop)


def test_stop_token_id_reason_and_requests_without_stops(engines):
    spec, _, prompts, full = engines
    t = full[1].token_ids[5]
    out, = spec.generate([prompts[1]], SP(max_tokens=MAX_TOKENS, stop_token_ids=[t]))
    assert out.finish_reason == "stop" and out.stop_reason == t and out.token_ids[-1] == t
    seq = spec.add_request(prompts[1], SP(max_tokens=2))
    assert seq.stop_checker is None                  # no stop strings: no text work per step
    spec.abort(seq)


def test_refusals(engines, monkeypatch):
    spec = engines[0]
    with pytest.raises(ValueError, match=r"sampling_params\[1\]: stop=.*mtpjax.generate.*"
                                         r"mtpjax.LLM"):
        validate_sampling_params([SP(), SP(stop="x")], 2, vocab_size=8,
                                 num_speculative_tokens=0, max_logprobs=0, caller="generate")
    monkeypatch.setattr(spec, "tokenizer", None)
    with pytest.raises(ValueError, match=r"sampling_params\[1\]: stop=\['x'\] \(prompt 1\).*"
                                         r"tokenizer"):
        spec.generate([[1, 2], [3, 4]], [SP(), SP(stop="x")])
    for bad in ([""], [1], b"x", None):
        with pytest.raises(ValueError, match="stop must be"):
            SP(stop=bad)
    with pytest.raises(ValueError, match="include_stop_str_in_output must be a bool"):
        SP(include_stop_str_in_output=1)
    assert SP(stop="ab").stop == ("ab",) and SP(stop=["a", "b"]).stop == ("a", "b")


def test_stop_strings_helper_include_and_reason():
    s = StopStrings(["cd", "bcx"], include_stop=True)
    assert s.feed("ab") == ("", False)                # "ab" could start "bcx"
    assert s.feed("cde") == ("abcd", True) and s.stop_reason == "cd"
    s = StopStrings(["cd"])
    assert s.feed("abc") == ("ab", False) and s.feed("d") == ("", True)
