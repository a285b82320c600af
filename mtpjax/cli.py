"""`mtpjax` command line.

    mtpjax generate [--model DIR | --random] [--prompt TEXT | --prompt-ids 1,2,3 ...] [options]
                    [--tensor-parallel N] [--replicas R] [--fuse-projections]
    mtpjax convert HF_DIR OUT_DIR [--dtype bfloat16]    Hugging Face folder -> Orbax folder
    mtpjax convert ORBAX_DIR OUT_DIR --to hf           and back (safetensors, config, tokenizer)
    mtpjax finetune --model DIR --out DIR [options]    fine-tune a model folder's MTP heads
    mtpjax acceptance --model DIR [options]            acceptance table of a model folder's heads
    mtpjax bench engine [options]       engine steps/s vs the bare jitted step (host overhead)
    mtpjax bench kernels [options]      the Pallas kernel tables (python -m mtpjax.bench.kernels)
    mtpjax bench e2e [options]          end-to-end decode speed at a model shape vs its floor and
                                        Hugging Face, engine start-up (python -m mtpjax.bench.e2e)
    mtpjax bench profile [options]      generate's loop vs the engine's steps (or a plain engine vs
                                        one at zero drafts), kernel by kernel, with host work
                                        (python -m mtpjax.bench.step_profile)
    mtpjax bench moe | mla [options]    the MoE expert layer / MLA attention against their floors
    mtpjax bench registers [options]    the kernels' registers and spills for sm_90, offline
                                        (python -m mtpjax.bench.register_report)
    mtpjax bench gpu-check [options]    Pallas vs reference tokens on the GPU (smoke check)
    mtpjax bench fp8-linear [options]   FP8 weight-only projections (kernel, XLA) against bf16
    mtpjax bench compile-time [options] one step program's compile time against depth
    mtpjax --version

Every option's help ends with its default (`_HelpFormatter`); the supported model families come
from `mtpjax.config.SUPPORTED_MODEL_TYPES`, so the help cannot drift from what loads.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
import textwrap
import time

import jax
import numpy as np

from mtpjax.config import SUPPORTED_MODEL_TYPES
from mtpjax.model.fused import MODES as FUSION_MODES

FAMILIES = ", ".join(SUPPORTED_MODEL_TYPES)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps descriptions' line breaks and appends "(default: X)" to an option's help when it has
    a meaningful default (None and store_true's False say nothing, so their help words it)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if ("%(default)" in text or "default" in text.lower() or default is None
                or default is False or default is argparse.SUPPRESS or not action.option_strings):
            return text
        return f"{text} (default: {'%(default)s'})" if text else "(default: %(default)s)"


def _model_args(p: argparse.ArgumentParser):
    g = p.add_argument_group("model")
    g.add_argument("--model", metavar="DIR",
                   help="Hugging Face model folder (config.json, *.safetensors, tokenizer.json) "
                        f"or an Orbax folder written by `mtpjax convert`; families: {FAMILIES}")
    g.add_argument("--random", action="store_true",
                   help="use a small random-weight model instead of --model (for trying things out)")
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="dtype the weights are loaded / initialized in")
    g.add_argument("--fp8", choices=["keep", "dequantize"], default="keep",
                   help="an FP8 checkpoint's weights: kept FP8 (dequantized in each matmul; "
                        "half the memory) or dequantized to --dtype at load (docs/fp8.md)")
    g.add_argument("--num-mtp-layers", type=int, default=None,
                   help="override the checkpoint's MTP module count (default: the checkpoint's; "
                        "random model: K with multi_layer, else 1)")
    g = p.add_argument_group("speculative decoding")
    g.add_argument("-k", "--num-speculative-tokens", type=int, default=0,
                   help="drafts per step, K (0 = no speculation)")
    g.add_argument("--method", choices=["chain", "multi_layer"], default="chain",
                   help="drafting: chain reuses MTP module 0 K times; multi_layer runs modules "
                        "1..K (needs K <= the module count)")
    from mtpjax.speculative.rules.registry import acceptance_rule_names  # the registered rules
    g.add_argument("--acceptance", choices=acceptance_rule_names(), default="rejection",
                   help="acceptance rule for sampled requests (greedy requests always match the "
                        "target's argmax); synthetic is benchmark-only")
    g.add_argument("--synthetic-accept-rate", type=float, default=0.7,
                   help="benchmark-only acceptance probability per draft (with --acceptance synthetic)")
    g = p.add_argument_group("engine")
    g.add_argument("--num-pages", type=int, default=2048,
                   help="KV cache pages in the pool (each holds --page-size tokens of every layer)")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV cache page")
    g.add_argument("--max-num-seqs", type=int, default=32,
                   help="most requests running in one engine step")
    g.add_argument("--max-num-batched-tokens", type=int, default=1024,
                   help="most tokens (prefill chunks + decode / verify tokens) in one engine step")
    g.add_argument("--min-token-bucket", type=int, default=None,
                   help="smallest step shape, a power of two (1: batch-1 decodes run unpadded, "
                        "three more compiles; default 1 for MoE models, 8 for dense ones)")
    g.add_argument("--no-prefix-caching", action="store_true",
                   help="do not share KV pages between prompts with a common prefix")
    g.add_argument("--attention", choices=["auto", "reference", "pallas"], default="auto",
                   help="attention implementation: auto = Pallas kernels on a GPU, the jnp "
                        "reference elsewhere")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of sampling, random weights and random prompts")
    g.add_argument("--tensor-parallel", type=int, default=1,
                   help="devices per engine (heads / experts split over them)")
    g.add_argument("--replicas", type=int, default=1,
                   help="independent engines (mtpjax.DataParallelLLM), each on --tensor-parallel "
                        "devices")
    g.add_argument("--fuse-projections", nargs="?", const="all", default=False,
                   choices=sorted(FUSION_MODES),
                   help="q/k/v and gate/up weights concatenated once at load (one device); "
                        "'qkv': only q/k/v (default: off; the flag alone: all)")


def _build(args):
    import mtpjax
    dtype = jax.numpy.bfloat16 if args.dtype == "bfloat16" else jax.numpy.float32
    K = args.num_speculative_tokens
    tokenizer = None
    eos_token_id = None
    if args.model:
        from mtpjax.checkpoint import load_pretrained
        overrides = {} if args.num_mtp_layers is None else {"num_mtp_layers": args.num_mtp_layers}
        ckpt = load_pretrained(args.model, dtype, fp8=args.fp8, **overrides)
        cfg, params = ckpt.cfg, ckpt.params
        tokenizer, eos_token_id = ckpt.tokenizer, ckpt.eos_token_id
    elif args.random:
        D = args.num_mtp_layers or (K if args.method == "multi_layer" and K else 1)
        cfg = mtpjax.ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=512,
                                 num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                                 num_mtp_layers=D)
        params = mtpjax.init_params(cfg, jax.random.PRNGKey(args.seed), dtype, std=0.05)
    else:
        raise SystemExit("give --model DIR or --random")
    spec = None
    if K:
        spec = mtpjax.SpecConfig(num_speculative_tokens=K, method=args.method,
                                 acceptance=args.acceptance,
                                 synthetic_accept_rate=args.synthetic_accept_rate)
    kw = dict(num_pages=args.num_pages, page_size=args.page_size,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=not args.no_prefix_caching, tokenizer=tokenizer,
              eos_token_id=eos_token_id, attention_impl=args.attention, seed=args.seed,
              fuse_projections=args.fuse_projections, min_token_bucket=args.min_token_bucket)
    if args.replicas > 1:
        return cfg, mtpjax.DataParallelLLM(params, cfg, spec, data_parallel=args.replicas,
                                           tensor_parallel=args.tensor_parallel, **kw)
    mesh = mtpjax.make_mesh(tensor_parallel=args.tensor_parallel) \
        if args.tensor_parallel > 1 else None
    return cfg, mtpjax.LLM(params, cfg, spec, mesh=mesh, **kw)


def _prompts(args, cfg):
    prompts = list(args.prompt or [])
    for ids in args.prompt_ids or []:
        prompts.append([int(t) for t in ids.split(",") if t.strip()])
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if args.num_random_prompts:
        rng = np.random.default_rng(args.seed)
        prompts += [rng.integers(0, cfg.vocab_size, size=int(n)).tolist()
                    for n in rng.integers(8, 128, size=args.num_random_prompts)]
    if not prompts:
        raise SystemExit("no prompts: give --prompt, --prompt-ids, --prompts-file or "
                         "--num-random-prompts")
    return prompts


def cmd_generate(args):
    import contextlib

    import mtpjax
    from mtpjax.demo import waiting
    with waiting(f"loading {args.model}" if args.model else "building a random-weight model"):
        cfg, llm = _build(args)
    prompts = _prompts(args, cfg)
    sp = mtpjax.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                               max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    # several prompts: the engine's per-request progress line; one prompt would show nothing
    # until it ends, and its first steps compile for seconds
    many = len(prompts) > 1
    with contextlib.nullcontext() if many else waiting("generating (the first steps compile)"):
        outs = llm.generate(prompts, sp, progress=many)
    dt = time.perf_counter() - t0
    for o in outs:
        shown = o.text if o.text is not None else o.token_ids
        print(f"[{o.request_id}] ({o.finish_reason}) {shown}")
    n_tok = sum(len(o.token_ids) for o in outs)
    steps = sum(o.num_verify_steps for o in outs)
    print(f"\n{len(outs)} requests, {n_tok} tokens in {dt:.2f}s ({n_tok / dt:.1f} tok/s, "
          f"compile included), {llm.num_steps} engine steps, {llm.num_preemptions} preemptions")
    if llm.spec is not None and steps:
        prop = sum(o.num_draft_tokens for o in outs)
        acc = sum(o.num_accepted_draft_tokens for o in outs)
        print(f"acceptance rate {acc / max(prop, 1):.3f} ({acc}/{prop} drafts); mean acceptance "
              f"length {(acc + steps) / steps:.2f} tokens per verify step")


class _ConvertProgress:
    """A rich progress bar when rich is installed, else a byte counter on stderr."""

    def __init__(self, enabled: bool):
        self.enabled, self.bar, self.task = enabled, None, None
        if enabled:
            try:
                from rich.console import Console
                from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                                           TimeRemainingColumn)
                self.bar = Progress(TextColumn("converting"), BarColumn(), DownloadColumn(),
                                    TimeRemainingColumn(), TextColumn("{task.description}"),
                                    console=Console(stderr=True), transient=True)
            except ImportError:
                pass

    def __call__(self, done: int, total: int, name: str):
        if not self.enabled:
            return
        if self.bar is not None:
            if self.task is None:
                self.bar.start()
                self.task = self.bar.add_task(name, total=total)
            self.bar.update(self.task, completed=done, description=name)
        else:
            sys.stderr.write(f"\r{done / 1e6:.1f}/{total / 1e6:.1f} MB  {name[:60]:<60}")
            sys.stderr.flush()

    def close(self):
        if self.bar is not None and self.task is not None:
            self.bar.stop()
        elif self.enabled and self.bar is None:
            sys.stderr.write("\n")


def cmd_convert(args):
    from mtpjax.checkpoint import convert
    progress = _ConvertProgress(not args.no_progress)
    try:
        summary = convert(args.src, args.dst, to=args.to, dtype=args.dtype,
                          max_shard_size=args.max_shard_size, progress=progress)
    finally:
        progress.close()
    print(summary.line())


BENCHES = {            # `mtpjax bench NAME` -> the module whose main(argv) it runs
    "engine": "mtpjax.bench.engine", "kernels": "mtpjax.bench.kernels", "e2e": "mtpjax.bench.e2e",
    "profile": "mtpjax.bench.step_profile", "moe": "mtpjax.bench.moe", "mla": "mtpjax.bench.mla",
    "registers": "mtpjax.bench.register_report", "gpu-check": "mtpjax.bench.gpu_check",
    "gemv-peer": "mtpjax.bench.gemv_peer", "mla-profile": "mtpjax.bench.mla_profile",
    "spec-features": "mtpjax.bench.spec_features", "fp8-linear": "mtpjax.bench.fp8_linear",
    "compile-time": "mtpjax.bench.compile_time",
}
# Commands whose module parses its own options. Run through here rather than `python -m`,
# because their packages import them, which makes runpy warn on every `python -m` run.
DELEGATES = {
    "finetune": ("mtpjax.train.finetune",
                 "fine-tune a model folder's MTP heads on a frozen target, acceptance before / "
                 "after"),
    "acceptance": ("mtpjax.speculative.acceptance_eval",
                   "acceptance table of a model folder's MTP heads on its held-out prompts"),
    "serve": ("mtpjax.serve.__main__",
              "OpenAI-compatible HTTP server for a model folder (/v1/completions, "
              "/v1/chat/completions, /metrics; MTP on when it has MTP modules)"),
}


def module_doc(module: str) -> str:
    """A module's docstring, read from its source without importing it (the benchmarks import
    GPU-only or heavy packages at the top, and `--help` must work anywhere)."""
    origin = importlib.util.find_spec(module).origin
    with open(origin) as f:
        return ast.get_docstring(ast.parse(f.read())) or ""


def _first_sentence(doc: str) -> str:
    para = " ".join(doc.split("\n\n", 1)[0].split())
    return para.split(". ")[0].rstrip(".")


def _run_module(module: str, prog: str, rest: list[str], doc: str | None = None):
    """module.main(rest) with `prog` in its usage line. argparse takes the program name from
    sys.argv[0], which is `mtpjax` here; the subcommand's own name says how to rerun it."""
    import importlib
    if doc and any(a in ("-h", "--help") for a in rest):
        print(f"{prog}: {doc}\n")
    argv0 = sys.argv[0]
    sys.argv[0] = prog
    try:
        rc = importlib.import_module(module).main(rest)
    finally:
        sys.argv[0] = argv0
    # some mains return their results for library callers; sys.exit would print them as errors
    return rc if isinstance(rc, int) else None


def cmd_bench(args):
    module = BENCHES[args.what]
    return _run_module(module, f"mtpjax bench {args.what}", args.rest, module_doc(module))


def _version() -> str:
    import mtpjax
    return f"mtpjax {mtpjax.__version__} (jax {jax.__version__}, Python {sys.version.split()[0]})"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in DELEGATES:
        # handed over whole: argparse's REMAINDER would not take options (--help, --model ...)
        # as the first thing after the command
        return _run_module(DELEGATES[argv[0]][0], f"mtpjax {argv[0]}", argv[1:])
    ap = argparse.ArgumentParser(
        prog="mtpjax", formatter_class=_HelpFormatter,
        description="Multi-token-prediction speculative decoding in JAX.\n\n"
                    f"Supported model families (config.json model_type): {FAMILIES}.",
        epilog="Examples:\n"
               "  mtpjax generate --model mtpjax/assets/tiny_code_mimo -k 3 --prompt 'def add(a, b):'\n"
               "  mtpjax generate --random -k 3 --num-random-prompts 16 --max-tokens 64\n"
               "  mtpjax convert path/to/hf_model out_dir --dtype bfloat16\n"
               "Getting started: docs/getting-started.md; `mtpjax COMMAND --help` for each "
               "command.")
    ap.add_argument("--version", action="version", version=_version())
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    g = sub.add_parser("generate", help="generate text / tokens with the LLM engine",
                       formatter_class=_HelpFormatter,
                       description="Generate with continuous batching and (with -k) MTP "
                                   "speculative decoding; prints outputs and acceptance stats.\n"
                                   f"Model families: {FAMILIES}.")
    _model_args(g)
    g.add_argument("--prompt", action="append",
                   help="a text prompt (needs the model's tokenizer.json); repeatable")
    g.add_argument("--prompt-ids", action="append", metavar="1,2,3",
                   help="a prompt as comma-separated token ids; repeatable")
    g.add_argument("--prompts-file", metavar="FILE", help="one text prompt per line")
    g.add_argument("--num-random-prompts", type=int, default=0,
                   help="add this many random token-id prompts")
    g.add_argument("--max-tokens", type=int, default=64, help="new tokens per request at most")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (0 = greedy)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0 = all)")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="sample within the smallest set of this probability mass (1 = all)")
    g.set_defaults(fn=cmd_generate)
    c = sub.add_parser("convert", help="convert a checkpoint (Hugging Face <-> Orbax)",
                       formatter_class=_HelpFormatter,
                       description=f"Hugging Face folder ({FAMILIES}; safetensors, sharded or "
                                   "not, FP8 block-scaled included) -> mtpjax Orbax folder, or "
                                   "back with --to hf. OUT_DIR is written all or nothing.")
    c.add_argument("src", metavar="SRC_DIR", help="the folder to convert")
    c.add_argument("dst", metavar="OUT_DIR", help="the folder to write (must not exist or be empty)")
    c.add_argument("--to", choices=["orbax", "hf"], default="orbax",
                   help="output format (default orbax: SRC_DIR is a Hugging Face folder)")
    c.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default=None,
                   help="dtype of the written arrays (default: as stored)")
    c.add_argument("--max-shard-size", default="5GB",
                   help="largest safetensors shard with --to hf (default 5GB)")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.set_defaults(fn=cmd_convert)
    for name, (module, text) in DELEGATES.items():
        d = sub.add_parser(name, help=text, add_help=False, formatter_class=_HelpFormatter,
                           description=f"{text} ({module}; `mtpjax {name} --help` for options)")
        d.add_argument("rest", nargs=argparse.REMAINDER, help="its options (--help lists them)")
    benches = "\n".join(textwrap.fill(f"{n:<14} {_first_sentence(module_doc(m))}", 96,
                                       initial_indent="  ", subsequent_indent=" " * 17)
                         for n, m in sorted(BENCHES.items()))
    b = sub.add_parser("bench", help="benchmarks and GPU checks (most need a GPU machine)",
                       formatter_class=_HelpFormatter,
                       description="Benchmarks and GPU checks; `mtpjax bench NAME --help` "
                                   f"describes one and lists its options.\n\n{benches}")
    b.add_argument("what", choices=sorted(BENCHES), metavar="NAME",
                   help="the benchmark: " + ", ".join(sorted(BENCHES)))
    b.add_argument("rest", nargs=argparse.REMAINDER, help="options of the benchmark")
    b.set_defaults(fn=cmd_bench)
    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as e:
        print(f"mtpjax: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
