"""Wiring: a model folder and the command-line options -> an LLM, its engine thread, the app.

`mtpjax serve MODEL` / `python -m mtpjax.serve MODEL` parse with `build_parser()` and run
`Server.from_args(args)`; tests build the same Server in-process (so they check what the
command runs) and run uvicorn on a thread.

MTP is on by default when the checkpoint has MTP modules: `--num-speculative-tokens` defaults to
their number (K = D), 0 turns speculation off.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from mtpjax.serve.engine_loop import EngineLoop
from mtpjax.serve.metrics import ServerMetrics
from mtpjax.serve.protocol import ServeContext


def build_parser(prog: str = "mtpjax serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description="OpenAI-compatible HTTP server (/v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /metrics) over one mtpjax engine.")
    p.add_argument("model", metavar="MODEL",
                   help="Hugging Face model folder or Orbax folder (`mtpjax convert`)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: the folder's name)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    g = p.add_argument_group("speculative decoding")
    g.add_argument("-k", "--num-speculative-tokens", type=int, default=None,
                   help="drafts per verify step; default: the checkpoint's MTP module count "
                        "(MTP on when it has any); 0 turns MTP off")
    g.add_argument("--method", choices=["chain", "multi_layer"], default="chain")
    from mtpjax.speculative.rules.registry import acceptance_rule, acceptance_rule_names
    served = [n for n in acceptance_rule_names() if acceptance_rule(n).offered_by_server]
    g.add_argument("--acceptance", choices=served,
                   default="rejection", help="the acceptance rule of every request (lossless "
                   "rules only over HTTP)")
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    g.add_argument("--fp8", choices=["keep", "dequantize"], default="keep",
                   help="an FP8 checkpoint's weights: kept FP8 or dequantized at load")
    g.add_argument("--num-pages", type=int, default=2048)
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=32)
    g.add_argument("--max-num-batched-tokens", type=int, default=1024)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-waiting-requests", type=int, default=256,
                   help="requests beyond this many waiting are answered 429 (back-pressure)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--warmup", dest="warmup", action="store_true", default=None,
                   help="compile every step bucket before serving (default off the CPU: the "
                        "largest before serving, the others in the background)")
    g.add_argument("--no-warmup", dest="warmup", action="store_false")
    return p


@dataclasses.dataclass
class Server:
    llm: object                  # mtpjax.LLM
    engine: EngineLoop           # not started until `app()`
    ctx: ServeContext
    max_model_len: int

    @classmethod
    def from_args(cls, args: argparse.Namespace, **llm_overrides) -> "Server":
        """Loads the model and builds the engine (not started). llm_overrides: extra LLM
        keyword arguments (tests)."""
        import jax.numpy as jnp

        from mtpjax.checkpoint import load_pretrained

        if not os.path.isdir(args.model):
            raise SystemExit(f"mtpjax serve: MODEL={args.model!r} is not a folder (give a "
                             "Hugging Face or Orbax model folder)")
        dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
        try:
            return cls._build(args, load_pretrained(args.model, dtype,
                                                    fp8=getattr(args, "fp8", None)),
                              llm_overrides)
        except ValueError as e:     # CheckpointError, SpecConfig / LLM option checks
            raise SystemExit(f"mtpjax serve: {e}") from None

    @classmethod
    def _build(cls, args, ckpt, llm_overrides: dict) -> "Server":
        import mtpjax
        from mtpjax.serve.chat_template import ChatTemplate, chat_encoder

        D = ckpt.cfg.num_mtp_layers
        K = D if args.num_speculative_tokens is None else args.num_speculative_tokens
        if K < 0:
            raise SystemExit(f"mtpjax serve: --num-speculative-tokens must be >= 0, got {K}")
        if K and not D:
            raise SystemExit(f"mtpjax serve: --num-speculative-tokens {K} needs MTP modules and "
                             f"{args.model} has none; use 0")
        spec = mtpjax.SpecConfig(num_speculative_tokens=K, method=args.method,
                                 acceptance=args.acceptance) if K else None
        kw = dict(num_pages=args.num_pages, page_size=args.page_size,
                  max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  max_model_len=args.max_model_len, tokenizer=ckpt.tokenizer,
                  eos_token_id=ckpt.eos_token_id, seed=args.seed,
                  max_waiting_requests=args.max_waiting_requests, warmup=args.warmup)
        kw.update(llm_overrides)
        llm = mtpjax.LLM(ckpt.params, ckpt.cfg, spec, **kw)
        tok = llm.tokenizer
        name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
        ctx = ServeContext(
            model_name=name, vocab_size=ckpt.cfg.vocab_size, num_speculative_tokens=K,
            acceptance=spec.acceptance if spec else None,
            max_completion_tokens=llm.scheduler.max_completion_tokens,
            encode=tok.encode if tok is not None else None,
            chat_template=ChatTemplate.from_folder(args.model) if tok is not None else None,
            encode_chat=chat_encoder(args.model, tok.encode) if tok is not None else None)
        engine = EngineLoop(llm, ServerMetrics(K, name))
        return cls(llm, engine, ctx, llm.max_model_len)

    def app(self):
        """Starts the engine thread; the ASGI app over it."""
        from mtpjax.serve.app import create_app
        self.engine.start()
        tok = self.llm.tokenizer
        decode = tok.decode if tok is not None else (lambda ids: "")
        return create_app(self.engine, self.ctx, decode, max_model_len=self.max_model_len)
