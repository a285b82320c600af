"""The OpenAI-compatible server end to end: the real `openai` client against a server the
module starts on localhost (the shipped tiny MTP model, built by the same code as
`mtpjax serve`), and the back-pressure / failure paths against a scripted engine."""

import asyncio
import os
import socket
import threading
import time
import types

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
import httpx  # noqa: E402

from mtpjax import SamplingParams  # noqa: E402
from mtpjax.engine.llm import QueueFullError  # noqa: E402
from mtpjax.serve.server import Server, build_parser  # noqa: E402

MODEL = os.path.join(os.path.dirname(__file__), "..", "..", "mtpjax", "assets",
                     "tiny_code_mtp3")
NAME = "tiny_code_mtp3"
PROMPTS = ["import os\n", "def foo(x):\n", "class A:\n    def __init__(self):\n",
           "for i in range(10):\n"]
CHAT = [{"role": "user", "content": "read a file"}]
N = 12                                  # max_tokens of the compared requests


def _free_socket():
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def _start_uvicorn(app):
    import uvicorn
    sock = _free_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture(scope="module")
def served():
    """(base url, references): the server, and greedy LLM.generate outputs on the same engine
    (run before the engine thread starts) for PROMPTS and the rendered CHAT prompt."""
    args = build_parser().parse_args([MODEL, "--max-num-seqs", "8", "--max-num-batched-tokens",
                                      "64", "--num-pages", "256", "--max-waiting-requests", "64",
                                      "--no-warmup"])
    # one step shape (every step padded to 64 tokens): a handful of XLA:CPU compiles instead
    # of one per bucket the batches below would reach
    srv = Server.from_args(args, min_token_bucket=64)
    assert srv.ctx.num_speculative_tokens == 3          # MTP on by default: K = the modules
    chat_ids = srv.ctx.encode_chat(srv.ctx.chat_template.render(CHAT))
    refs = srv.llm.generate(PROMPTS + [chat_ids], SamplingParams(max_tokens=N))
    server, thread, url = _start_uvicorn(srv.app())
    yield types.SimpleNamespace(url=url, refs=refs, chat_ids=chat_ids, srv=srv)
    server.should_exit = True
    thread.join(10)
    srv.engine.close()


def test_openai_client_end_to_end(served):
    """One test drives the server through every check below, in order: pytest-xdist's `load`
    distribution would otherwise split the checks over both workers, each starting (and
    compiling) a server of its own."""
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0,
                           timeout=60)
    check_models_health_metrics(served)
    check_completion_matches_llm_generate_and_stream(served, client)
    check_chat_completion_and_stream(served, client)
    check_mtp_options_per_request(served, client)
    check_stop_string_cuts_the_text(served, client)
    check_response_format_holds_the_answer_to_json(client)
    for kwargs, param in BAD_REQUESTS:
        check_bad_request_names_the_field(client, kwargs, param)
    check_bad_chat_and_unknown_model(served, client)
    check_cancel_mid_stream_aborts_in_the_engine(served, client)
    check_50_concurrent_clients_all_complete(served)


def _metrics(url) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def _wait_metrics(url, cond, what: str, timeout: float = 20.0) -> dict[str, float]:
    """/metrics once `cond` holds of it: counters and gauges are updated at slightly different
    moments by the engine thread, so one scrape may catch them in between."""
    deadline = time.monotonic() + timeout
    while not cond(m := _metrics(url)):
        assert time.monotonic() < deadline, f"timed out waiting for: {what}; /metrics: {m}"
        time.sleep(0.02)
    return m


def check_models_health_metrics(served):
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}
    models = openai.OpenAI(base_url=served.url + "/v1", api_key="none").models.list()
    assert [m.id for m in models.data] == [NAME]
    assert _metrics(served.url)["mtpjax_num_speculative_tokens"] == 3


def check_completion_matches_llm_generate_and_stream(served, client):
    for prompt, ref in zip(PROMPTS[:2], served.refs):
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=N, temperature=0,
                                      extra_body={"return_token_ids": True})
        c = r.choices[0]
        assert c.token_ids == ref.token_ids and c.text == ref.text
        assert c.finish_reason == "length" and r.usage.completion_tokens == N
        assert r.mtp["draft_tokens"] > 0                # MTP was on for the request
        chunks = list(client.completions.create(
            model=NAME, prompt=prompt, max_tokens=N, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"return_token_ids": True}))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text
        assert sum((ch.choices[0].token_ids for ch in chunks if ch.choices), []) == ref.token_ids
        assert chunks[-1].usage.completion_tokens == N
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


def check_chat_completion_and_stream(served, client):
    ref = served.refs[-1]
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=N, temperature=0,
                                       extra_body={"return_token_ids": True})
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == ref.text
    assert c.prompt_token_ids == served.chat_ids and c.token_ids == ref.token_ids
    assert r.usage.prompt_tokens == len(served.chat_ids)
    stream = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=N,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"


def check_mtp_options_per_request(served, client):
    ref = served.refs[0]
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=N, temperature=0,
                                  extra_body={"num_speculative_tokens": 0,
                                              "acceptance": "rejection",
                                              "return_token_ids": True})
    assert r.mtp["draft_tokens"] == 0 and r.choices[0].token_ids == ref.token_ids   # lossless
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="x", max_tokens=2,
                                  extra_body={"acceptance": "greedy"})
    assert e.value.body["param"] == "acceptance" and "'rejection'" in e.value.body["message"]


def check_stop_string_cuts_the_text(served, client):
    ref = served.refs[0].text                 # "import sys\nimport sys\n..."
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=N, temperature=0,
                                  stop=["sys\n"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == ref[:ref.index("sys\n")]


def check_response_format_holds_the_answer_to_json(client):
    """OpenAI's response_format through the engine's structured output (greedy and sampled)."""
    import json
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    r = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=40, temperature=0,
                                       response_format=fmt)
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"n", "ok"} and 0 <= value["n"] <= 99 and isinstance(value["ok"], bool)
    r = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=40, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(r.choices[0].text), dict)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=4,
                                       response_format={"type": "xml"})
    assert e.value.body["param"] == "response_format"


BAD_REQUESTS = [                       # (request fields, the field the 400 must name)
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=100000), "max_tokens"),
    (dict(temperature=-1), "temperature"),
    (dict(n=3), "n"),
    (dict(extra_body={"num_speculative_tokens": 9}), "num_speculative_tokens"),
    (dict(extra_body={"num_speculative_tokenz": 1}), "num_speculative_tokenz"),
]


def check_bad_request_names_the_field(client, kwargs, param):
    kwargs = {"max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="x = 1", **kwargs)
    assert e.value.status_code == 400 and e.value.body["param"] == param
    assert param in e.value.body["message"]


def check_bad_chat_and_unknown_model(served, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=[{"role": "user"}], max_tokens=2)
    assert e.value.body["param"] == "messages" and "messages[0]" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert e.value.body["param"] == "model"
    r = httpx.post(served.url + "/v1/completions", content=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def check_cancel_mid_stream_aborts_in_the_engine(served, client):
    # an earlier request cut by a stop string is aborted by the engine thread after its answer
    # was sent: count from a settled server, or that abort lands inside this check's window
    before = _wait_metrics(served.url, lambda m: m["mtpjax_requests_active"] == 0,
                           "earlier requests settled")['mtpjax_requests_total{outcome="aborted"}']
    stream = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=200,
                                       temperature=0, stream=True)
    got = [next(iter(stream)) for _ in range(2)]
    assert all(ch.choices[0].finish_reason is None for ch in got)
    stream.close()                                    # the client goes away
    _wait_metrics(served.url, lambda m: m['mtpjax_requests_total{outcome="aborted"}'] == before + 1
                  and m["mtpjax_requests_active"] == 0 and m["mtpjax_requests_running"] == 0,
                  "the closed stream's request aborted, nothing running")
    assert not served.srv.llm.scheduler.running and not served.srv.llm.scheduler.waiting
    # a non-streamed request whose client gives up (times out, closes the connection)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.url + "/v1/completions", timeout=0.3, json=dict(
            model=NAME, prompt=PROMPTS[0], max_tokens=200, temperature=0))
    _wait_metrics(served.url, lambda m: m['mtpjax_requests_total{outcome="aborted"}'] == before + 2
                  and m["mtpjax_requests_active"] == 0, "the dropped request aborted")


def check_50_concurrent_clients_all_complete(served):
    async def main():
        client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="none",
                                    max_retries=0, timeout=120)

        async def one(i):
            p = i % len(PROMPTS)
            if i % 2:
                r = await client.completions.create(model=NAME, prompt=PROMPTS[p], max_tokens=N,
                                                    temperature=0)
                return p, r.choices[0].text, r.choices[0].finish_reason
            text, reason = [], None
            async for ch in await client.completions.create(
                    model=NAME, prompt=PROMPTS[p], max_tokens=N, temperature=0, stream=True):
                text.append(ch.choices[0].text)
                reason = ch.choices[0].finish_reason or reason
            return p, "".join(text), reason

        try:
            return await asyncio.gather(*(one(i) for i in range(50)))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert len(results) == 50
    for p, text, reason in results:
        assert reason == "length" and text == served.refs[p].text
    # (the engine thread publishes its gauges just after handing out the last tokens)
    m = _wait_metrics(served.url, lambda m: m["mtpjax_requests_active"] == 0
                      and m["mtpjax_requests_waiting"] == 0, "no request left in the server")
    assert m["mtpjax_spec_acceptance_rate"] > 0          # the acceptance shows in /metrics
    assert m['mtpjax_spec_position_acceptance{position="1"}'] > 0
    assert m["mtpjax_tokens_per_second"] > 0


# ---- back-pressure and engine failures, on a scripted engine (no model) -------------------------

class ScriptedLLM:
    """add_request / step / abort like mtpjax.LLM: at most `max_waiting` requests wait, `hold`
    keeps step() from progressing, `fail` makes step() raise, `bug` makes add_request raise
    an unexpected error; each request gets 3 tokens."""

    spec = None

    def __init__(self, max_waiting=1):
        self.max_waiting, self.hold, self.fail, self.next_id = max_waiting, False, False, 0
        self.bug = False
        self.scheduler = types.SimpleNamespace(running=[], waiting=[])

    def add_request(self, ids, sp):
        if self.bug:
            raise KeyError("a bug in add_request")
        if len(self.scheduler.waiting) >= self.max_waiting:
            raise QueueFullError("the waiting queue holds max_waiting_requests=1 requests")
        seq = types.SimpleNamespace(seq_id=self.next_id, is_finished=False, finish_reason=None,
                                    n=0, num_verify_steps=0, num_draft_tokens=0,
                                    num_accepted_draft_tokens=0)
        self.next_id += 1
        self.scheduler.waiting.append(seq)
        return seq

    def step(self):
        time.sleep(0.005)
        if self.fail:
            raise RuntimeError("device on fire")
        if self.hold:
            return []
        out = []
        for seq in list(self.scheduler.waiting):
            seq.n += 1
            if seq.n == 3:
                seq.is_finished, seq.finish_reason = True, "length"
                self.scheduler.waiting.remove(seq)
            out.append((seq, [65 + seq.n]))
        return out

    def abort(self, seq):
        self.scheduler.waiting.remove(seq)


def _scripted_app(llm):
    from mtpjax.serve.app import create_app
    from mtpjax.serve.engine_loop import EngineLoop
    from mtpjax.serve.protocol import ServeContext
    engine = EngineLoop(llm, idle_wait_s=0.01, max_step_failures=2).start()
    ctx = ServeContext(model_name="s", vocab_size=128, num_speculative_tokens=0,
                       acceptance=None, max_completion_tokens=lambda n: 64,
                       encode=lambda s: [ord(c) % 128 for c in s], chat_template=None)
    decode = lambda ids: "".join(chr(i) for i in ids)     # noqa: E731
    return engine, create_app(engine, ctx, decode, max_model_len=64)


def test_full_queue_answers_429_and_engine_failures_503():
    llm = ScriptedLLM()
    engine, app = _scripted_app(llm)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as c:
            body = {"model": "s", "prompt": "hi", "max_tokens": 3}
            llm.hold = True
            first = asyncio.create_task(c.post("/v1/completions", json=body))
            while not llm.scheduler.waiting:
                await asyncio.sleep(0.005)
            busy = await c.post("/v1/completions", json=body)
            assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
            assert busy.json()["error"]["code"] == "queue_full"
            llm.hold = False
            done = await first
            assert done.status_code == 200 and done.json()["choices"][0]["text"] == "BCD"
            llm.fail = True                       # every step raises: the request fails, 503
            failed = await c.post("/v1/completions", json=body)
            assert failed.status_code == 503 and "device on fire" in failed.text
            llm.fail, llm.bug = False, True       # add_request raises something unexpected
            failed = await c.post("/v1/completions", json=body)
            assert failed.status_code == 503 and "a bug in add_request" in failed.text
            llm.bug = False
            again = await c.post("/v1/completions", json=body)   # and the server goes on
            assert again.status_code == 200
            assert (await c.get("/health")).status_code == 200
            m = (await c.get("/metrics")).text
            assert 'mtpjax_requests_total{outcome="rejected"} 1' in m
            assert 'mtpjax_requests_total{outcome="failed"} 2' in m
            engine.close()
            assert (await c.get("/health")).status_code == 503
            gone = await c.post("/v1/completions", json=body)
            assert gone.status_code == 503

    asyncio.run(main())


def test_command_line(capsys):
    from mtpjax.serve.__main__ import main
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--num-speculative-tokens" in out and "--port" in out
    with pytest.raises(SystemExit, match="MODEL='no/such/folder' is not a folder"):
        main(["no/such/folder"])
    with pytest.raises(SystemExit, match="mtpjax serve: method 'multi_layer' needs "
                                         "num_speculative_tokens <= num_mtp_layers"):
        main([MODEL, "-k", "5", "--method", "multi_layer", "--no-warmup"])
