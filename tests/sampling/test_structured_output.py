"""Structured output (SamplingParams.structured_output): JSON schema, regex and EBNF grammars
constrain a request's tokens, losslessly under speculative decoding.

On the shipped tiny model: outputs always parse and validate against random JSON schemas; greedy
speculative decoding (chain and multi_layer, K = 0..3 per request, with preemption) equals plain
decoding token for token; sampled outputs of a regex grammar pass a chi-square test against
plain decoding; unconstrained requests in the same batch are unchanged; and a batch without a
grammar row compiles the program it compiled before (the guard)."""

import dataclasses
import json
import os
import re

import jax
import numpy as np
import pytest

import mtpjax
from mtpjax import SamplingParams, SpecConfig, StructuredOutput

xgrammar = pytest.importorskip("xgrammar")

MODEL = os.path.join(os.path.dirname(mtpjax.__file__), "assets", "tiny_code_mtp3")
WORDS = ["def", "add", "(a, b)", "return", "x", "for i in range(3):", "\n", "{", "name", "json"]
# one token bucket (T = 64) and few first-pass buckets: few programs to compile
ENGINE = dict(page_size=8, max_num_seqs=8, max_num_batched_tokens=64, min_token_bucket=64,
              warmup=False)


@pytest.fixture(scope="module")
def engines():
    """plain, chain K=3 and multi_layer K=3 engines; the speculative ones have a cache small
    enough that 8 concurrent requests preempt each other."""
    plain = mtpjax.LLM.from_pretrained(MODEL, None, num_pages=128, **ENGINE)
    chain = mtpjax.LLM.from_pretrained(MODEL, SpecConfig(num_speculative_tokens=3),
                                       num_pages=14, max_logprobs=2, **ENGINE)
    multi = mtpjax.LLM.from_pretrained(
        MODEL, SpecConfig(num_speculative_tokens=3, method="multi_layer"), num_pages=14,
        **ENGINE)
    return dict(plain=plain, chain=chain, multi_layer=multi)


def random_schema(rng) -> dict:
    """An object with 1..3 required fields of string / int / bool / enum / array types (bounded,
    so a random model can finish)."""
    props = {}
    for j in range(int(rng.integers(1, 4))):
        kind = rng.choice(["string", "integer", "boolean", "enum", "array"])
        if kind == "string":
            f = {"type": "string", "maxLength": int(rng.integers(1, 6))}
        elif kind == "integer":
            f = {"type": "integer", "minimum": 0, "maximum": int(rng.integers(1, 1000))}
        elif kind == "boolean":
            f = {"type": "boolean"}
        elif kind == "enum":
            f = {"enum": [str(x) for x in rng.choice(["red", "green", "blue", "x", "yy"],
                                                     int(rng.integers(1, 4)), replace=False)]}
        else:
            f = {"type": "array", "items": {"type": rng.choice(["boolean", "integer"])},
                 "maxItems": int(rng.integers(1, 3))}
            if f["items"]["type"] == "integer":
                f["items"].update(minimum=0, maximum=9)
        props[f"f{j}"] = f
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


def random_prompt(rng) -> str:
    return " ".join(rng.choice(WORDS, int(rng.integers(1, 6))))


def check_schema(value, schema) -> None:
    """jsonschema's validation when installed, else the generator's fields checked by hand."""
    try:
        import jsonschema
    except ImportError:
        assert isinstance(value, dict) and set(value) == set(schema["properties"])
        for k, f in schema["properties"].items():
            v = value[k]
            if "enum" in f:
                assert v in f["enum"]
            elif f["type"] == "string":
                assert isinstance(v, str) and len(v) <= f["maxLength"]
            elif f["type"] == "integer":
                assert isinstance(v, int) and f["minimum"] <= v <= f["maximum"]
            elif f["type"] == "boolean":
                assert isinstance(v, bool)
            else:
                assert isinstance(v, list) and len(v) <= f["maxItems"]
        return
    jsonschema.validate(value, schema)


def schema_requests(seed: int, n: int, temperature: float = 0.0):
    rng = np.random.default_rng(seed)
    schemas = [random_schema(rng) for _ in range(n)]
    prompts = [random_prompt(rng) for _ in range(n)]
    sps = [SamplingParams(max_tokens=48, temperature=temperature, seed=seed * 100 + i,
                          num_speculative_tokens=i % 4,
                          structured_output=StructuredOutput(json_schema=s))
           for i, s in enumerate(schemas)]
    return schemas, prompts, sps


def plain_params(sps):
    return [dataclasses.replace(sp, num_speculative_tokens=None) for sp in sps]


# ---- outputs parse; greedy speculative == plain, with preemption --------------------------------

@pytest.mark.parametrize("seed", [0, 1])
def test_json_schema_outputs_parse_and_greedy_speculation_equals_plain(engines, seed):
    """Random schemas and prompts, 8 requests at once (K = 0..3 per request): every output is
    JSON valid under its schema and ends with eos; chain and multi_layer give plain decoding's
    tokens, through preemptions."""
    schemas, prompts, sps = schema_requests(seed, 8)
    ref = engines["plain"].generate(prompts, plain_params(sps))
    for out, schema in zip(ref, schemas):
        assert out.finish_reason == "stop", out.text
        check_schema(json.loads(out.text), schema)
    for name in ("chain", "multi_layer"):
        llm = engines[name]
        before = llm.num_preemptions
        got = llm.generate(prompts, sps)
        assert [o.token_ids for o in got] == [o.token_ids for o in ref], name
        assert llm.num_preemptions > before, name        # the grammar state survived them


def test_sampled_json_outputs_parse(engines):
    """Sampled (temperature 1) speculative outputs validate too."""
    schemas, prompts, sps = schema_requests(7, 8, temperature=1.0)
    for out, schema in zip(engines["chain"].generate(prompts, sps), schemas):
        assert out.finish_reason == "stop", out.text
        check_schema(json.loads(out.text), schema)


# ---- sampled: the same distribution as plain decoding ----------------------------------------

REGEX = "[ab]{1,3}c?"


def test_sampled_regex_distribution_matches_plain(engines):
    """Temperature 1 under a regex grammar: the law of the whole output (token sequence) under
    chain speculation (K = 1..3, rejection sampling, drafts unmasked) equals plain decoding's
    (two-sample chi-square); every output matches the regex."""
    from scipy import stats
    n = 240
    so = StructuredOutput(regex=REGEX)
    laws = {}
    for name in ("plain", "chain"):
        sps = [SamplingParams(temperature=1.0, max_tokens=6, structured_output=so,
                              seed=(0 if name == "plain" else 10**6) + i,
                              num_speculative_tokens=None if name == "plain" else 1 + i % 3)
               for i in range(n)]
        outs = engines[name].generate(["x ="] * n, sps)
        for o in outs:
            assert o.finish_reason == "stop" and re.fullmatch(REGEX, o.text), o.text
        laws[name] = [tuple(o.token_ids) for o in outs]
    cells = sorted(set(laws["plain"]) | set(laws["chain"]))
    table = np.array([[law.count(c) for c in cells] for law in laws.values()])
    big = table.sum(0) >= 10                        # pool the rare cells
    table = np.concatenate([table[:, big], table[:, ~big].sum(1, keepdims=True)], 1)
    table = table[:, table.sum(0) > 0]
    assert table.shape[1] >= 3                       # the law is not trivial
    assert stats.chi2_contingency(table).pvalue > 1e-3, table


# ---- per request: unconstrained rows are unchanged ---------------------------------------------

def test_unconstrained_rows_equal_their_solo_outputs(engines):
    """A batch mixing grammar rows with greedy and seeded sampled rows without one: the latter
    give what they give alone (in a batch with no grammar at all). Logprobs of a grammar row
    are those of the masked distribution: its chosen tokens have finite logprobs, and the
    structured step's appended drafts do not disturb the logprob columns."""
    llm = engines["chain"]
    rng = np.random.default_rng(3)
    schemas, prompts, gsps = schema_requests(3, 3)
    gsps[0] = dataclasses.replace(gsps[0], logprobs=2)
    free = [random_prompt(rng) for _ in range(3)]
    fsps = [SamplingParams(max_tokens=12), SamplingParams(max_tokens=12, temperature=1.0, seed=4),
            SamplingParams(max_tokens=12, temperature=0.7, top_k=20, seed=5)]
    mixed = llm.generate(prompts + free, gsps + fsps)
    solo = llm.generate(free, fsps)
    assert [o.token_ids for o in mixed[3:]] == [o.token_ids for o in solo]
    lps = mixed[0].logprobs
    assert len(lps) == len(mixed[0].token_ids)
    for tok, lp in zip(mixed[0].token_ids, lps):
        assert np.isfinite(lp[tok]) and lp[tok] <= 0 and all(0 <= t < llm.cfg.vocab_size
                                                              for t in lp)
    for out, schema in zip(mixed[:3], schemas):
        check_schema(json.loads(out.text), schema)


def test_regex_and_ebnf_grammars(engines):
    """regex, EBNF and json_object specs constrain the output (greedy and sampled)."""
    llm = engines["chain"]
    ebnf = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'
    sps = [SamplingParams(max_tokens=30, structured_output=StructuredOutput(regex="[0-9]{2,4}")),
           SamplingParams(max_tokens=30, temperature=1.0, seed=2,
                          structured_output=StructuredOutput(grammar=ebnf)),
           SamplingParams(max_tokens=60, structured_output=StructuredOutput(json_object=True))]
    outs = llm.generate(["a", "b", "c"], sps)
    assert re.fullmatch("[0-9]{2,4}", outs[0].text), outs[0].text
    if outs[1].finish_reason == "stop":
        assert re.fullmatch(r"\((\d|x)(,(\d|x))*\)", outs[1].text), outs[1].text
    else:
        assert re.fullmatch(r"\((\d|x)(,(\d|x))*,?", outs[1].text), outs[1].text
    if outs[2].finish_reason == "stop":
        assert isinstance(json.loads(outs[2].text), dict)
    else:
        assert outs[2].text.startswith("{")


# ---- the guard: a batch without grammar rows runs the program it ran before ---------------------

def test_batches_without_grammar_compile_the_same_program(engines, monkeypatch):
    """Without a grammar row the packed batch has no bitmask (its layout and warm-up key are
    unchanged) and the step's program never traces the masking: lowered with the mask function
    made to fail, it is the same HLO as the default; a structured step holds no device-side
    conditional."""
    from mtpjax.engine import runner as runner_mod
    from mtpjax.engine.scheduler import SchedulerOutput
    import sys
    mixed_mod = sys.modules["mtpjax.speculative.mixed_step"]
    r = engines["chain"].runner
    empty, _ = r.pack(SchedulerOutput([], [], r.K))
    assert empty.sampling.token_bitmask is None
    inputs, shape = r.device_inputs(empty)
    size = runner_mod.pack_host(empty).size
    kw = dict(first_pass_len=64, backend=r.backend, shape=shape, logprobs=r.max_logprobs,
              sampling_mode="filter")

    def hlo(inputs, **extra):
        return runner_mod._step.lower(r.params, r.cfg, r.spec, r.state, inputs, **kw,
                                      **extra).as_text()

    base = hlo(inputs)

    def fail(*a, **k):
        raise AssertionError("the bitmask was traced for a batch without grammar rows")

    monkeypatch.setattr(mixed_mod, "apply_token_bitmask", fail)
    assert hlo(inputs) == base == hlo(inputs, structured=False)
    monkeypatch.undo()
    W = (r.cfg.vocab_size + 31) // 32
    masked = empty.replace(sampling=empty.sampling.replace(
        token_bitmask=np.full((r.max_num_seqs, r.K + 1, W), -1, np.int32)))
    assert runner_mod.pack_host(masked).size == size + r.max_num_seqs * (r.K + 1) * W
    text = runner_mod._step.lower(r.params, r.cfg, r.spec, r.state,
                                  r.device_inputs(masked)[0], **kw, structured=True
                                  ).compile().as_text()
    assert "conditional(" not in text


def test_bitmask_masks_exactly_the_zero_bits():
    """apply_token_bitmask: -inf exactly where the bit is 0, logits untouched elsewhere."""
    from mtpjax.structured.bitmask import apply_token_bitmask, bitmask_width
    rng = np.random.default_rng(0)
    for V in (5, 32, 70):
        bits = rng.random((3, 2, V)) < 0.5
        words = np.zeros((3, 2, bitmask_width(V)), np.uint32)
        for v in range(V):
            words[..., v // 32] |= bits[..., v].astype(np.uint32) << (v % 32)
        logits = rng.normal(size=(3, 2, V)).astype(np.float32)
        out = np.asarray(apply_token_bitmask(jax.numpy.asarray(logits),
                                             jax.numpy.asarray(words.view(np.int32))))
        np.testing.assert_array_equal(out, np.where(bits, logits, -np.inf))


# ---- where it is refused, and bad input ---------------------------------------------------------

def test_generate_and_engines_without_tokenizer_refuse_it(engines):
    llm = engines["plain"]
    sp = SamplingParams(structured_output=StructuredOutput(regex="a+"))
    with pytest.raises(ValueError, match="structured output needs the engine .*LLM.*cannot run "
                                         "a grammar matcher"):
        mtpjax.generate(llm.runner.params, llm.cfg, [[1, 2]], max_new_tokens=2, sampling=sp)
    bare = mtpjax.LLM(llm.runner.params, llm.cfg, None, num_pages=8, page_size=8, warmup=False)
    with pytest.raises(ValueError, match="structured_output .*needs the LLM's tokenizer"):
        bare.generate([[1, 2]], sp)
    with pytest.raises(ValueError, match=r"prompt 0.*regex cannot be compiled: .*Unclosed.*"
                                         r"got regex='\[a'"):
        llm.generate(["x"], SamplingParams(structured_output=StructuredOutput(regex="[a")))


@pytest.mark.parametrize("kw,match", [
    (dict(), "exactly one of"),
    (dict(regex="a", grammar="root ::= \"a\""), "exactly one of"),
    (dict(json_schema="{not json"), "json_schema is not valid JSON"),
    (dict(json_schema=[1]), "json_schema must be a JSON schema"),
    (dict(regex=""), "regex must be a non-empty string"),
    (dict(json_object=1), "json_object must be a bool"),
])
def test_structured_output_refuses_bad_specs(kw, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutput(**kw)
    with pytest.raises(ValueError, match="structured_output must be a mtpjax.StructuredOutput"):
        SamplingParams(structured_output={"regex": "a"})


def test_server_response_format_becomes_structured_output():
    """/v1/completions and /v1/chat/completions take OpenAI's response_format; a bad one is a
    400 naming the field."""
    from mtpjax.serve.protocol import RequestError, ServeContext, parse_completion
    ctx = ServeContext(model_name="m", vocab_size=16, num_speculative_tokens=2,
                       acceptance="rejection", max_completion_tokens=lambda n: 32 - n,
                       encode=None)
    body = {"model": "m", "prompt": [1, 2]}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for fmt, want in [
            ({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
             StructuredOutput(json_schema=schema)),
            ({"type": "json_object"}, StructuredOutput(json_object=True)),
            ({"type": "text"}, None), (None, None)]:
        sp = parse_completion({**body, "response_format": fmt}, ctx).sampling_params
        assert sp.structured_output == want, fmt
    for bad in [{"type": "xml"}, {"type": "json_schema"}, "json", {"type": "json_schema",
                                                                   "json_schema": {"schema": 3}}]:
        with pytest.raises(RequestError, match="response_format|json_schema") as e:
            parse_completion({**body, "response_format": bad}, ctx)
        assert e.value.param == "response_format", bad
