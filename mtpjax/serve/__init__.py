"""Serving: an OpenAI-compatible HTTP server over one engine, and the text layer under it.

    detokenize.py     token ids arriving a few at a time -> correct text deltas
    stop_strings.py   OpenAI `stop` strings over streamed text
    chat_template.py  chat messages -> prompt text (the checkpoint's jinja template)
    protocol.py       OpenAI request bodies -> checked engine requests (400 naming the field)
    engine_loop.py    the thread that owns the engine; inbox in, per-request updates out
    metrics.py        counters and gauges, Prometheus text format
    app.py            the FastAPI app (routes, SSE, disconnect -> abort, 429 on a full queue)
    server.py         model folder + options -> LLM, engine thread, app
    __main__.py       `python -m mtpjax.serve MODEL --port P` (`main(argv)`)

Only the text modules are imported here; the app needs the `serve` extra (fastapi, uvicorn).
docs/serving.md describes the endpoints.
"""

from mtpjax.serve.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate, ChatTemplateError
from mtpjax.serve.detokenize import IncrementalDetokenizer
from mtpjax.serve.stop_strings import StopStrings

__all__ = ["ChatTemplate", "ChatTemplateError", "DEFAULT_CHAT_TEMPLATE",
           "IncrementalDetokenizer", "StopStrings"]
