"""`python -m mtpjax.train.tiny`: train the tiny MiMo-style code models shipped with mtpjax.

A Qwen2 target plus `--mtp-layers` MTP module(s) (model_type "mimo", so it loads through the
MiMo path of `mtpjax.checkpoint.load_hf`), trained jointly on Python source files with the
library's joint loss (`mtpjax.train.joint_loss`, docs/training.md):

    loss = CE(target, x_{i+1}) + sum_s mtp_weight * depth_decay^s * CE(depth s, x_{i+s+2})

Depth s runs module `s % D` (D = --mtp-layers) in the regime of `--regime`: "multi_layer" (the
previous depth's hidden state at the same position, as DeepSeek-V3 trains and as multi_layer
drafting runs), "chain" (the previous depth's output one position earlier, over target-derived
context, as chain drafting runs) or "both" (the mean of the two).

Everything is reproducible from the flags: files sorted by path, every `--heldout-every`-th file
held out, a byte-level BPE tokenizer trained on the training files, fixed seeds, and a
deterministic window order. `--seconds` is a wall-clock budget for the training loop (the
learning-rate schedule follows elapsed time then, so the step count depends on the device;
it is printed, and `--steps N` alone reproduces a run exactly).

The output folder (replaced if it exists) is a Hugging Face folder written by
`mtpjax.checkpoint.export_hf` (config.json, model.safetensors in bf16, tokenizer.json), plus
`prompts.json` (held-out prompts for the demo and tests), `training.json` (flags, log and
metrics) and a README.md with the measured numbers: teacher-forced losses per regime and, for
models with several modules (or `--acceptance-table on`), measured acceptance of chain drafting
at K = 1..max(3, D) and multi_layer drafting at each of those K <= D on the held-out prompts.
`mtpjax.LLM.from_pretrained(out)` loads it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import mtpjax
from mtpjax.checkpoint import Assets, export_hf
from mtpjax.config import ModelConfig
from mtpjax.train.data import (EOS, encode_stream, fixed_windows, heldout_prompts, list_files,
                               read_corpus, sample_windows, train_tokenizer)
from mtpjax.train.loop import evaluate_windows, fit
from mtpjax.train.loss import LossConfig
from mtpjax.train.step import Trainer, adamw

__all__ = ["list_files", "main", "model_config", "parse_args"]


def model_config(args, vocab_size: int, eos_id: int) -> tuple[ModelConfig, dict]:
    """The ModelConfig and the config.json dict it comes from (a MiMo config read back)."""
    hf = dict(model_type="mimo", architectures=["MiMoForCausalLM"], vocab_size=vocab_size,
              hidden_size=args.hidden, intermediate_size=args.intermediate,
              num_hidden_layers=args.layers, num_attention_heads=args.heads,
              num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
              hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0,
              max_position_embeddings=args.context, attention_bias=True,
              tie_word_embeddings=args.tie_embeddings, num_nextn_predict_layers=args.mtp_layers,
              bos_token_id=eos_id, eos_token_id=eos_id)
    return ModelConfig.from_hf(hf), hf


# ---- output -----------------------------------------------------------------------------------

def summary_table(metrics: dict) -> str:
    """Teacher-forced metrics per split and regime (markdown)."""
    S = len(metrics["train"]["mtp_loss"][0])
    rows = ["| split | regime | target loss | target top-1 | " + " | ".join(
        f"MTP depth {d + 1} loss | MTP depth {d + 1} top-1 | depth {d + 1} == target argmax"
        for d in range(S)) + " |"]
    rows.append("|" + "---|" * (4 + 3 * S))
    for split in ("train", "heldout"):
        m = metrics[split]
        for r, regime in enumerate(m["regimes"]):
            cells = [split, regime, f"{m['target_loss']:.3f}", f"{m['target_acc']:.3f}"]
            for d in range(S):
                cells += [f"{m['mtp_loss'][r][d]:.3f}", f"{m['mtp_acc'][r][d]:.3f}",
                          f"{m['mtp_agree_with_target'][r][d]:.3f}"]
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


README = """# {name}: a tiny trained target + MTP model

A {size_mb:.1f} MB MiMo-style checkpoint (Hugging Face folder, model_type `mimo`: a Qwen2 target
with {layers} layers, hidden {hidden}, {heads} heads ({kv_heads} KV), intermediate {intermediate},
context {context}, plus {mtp} MTP module(s); {params_m:.2f} M parameters stored in bfloat16) and
its byte-level BPE tokenizer ({vocab} tokens, `<|endoftext|>` = id 0 = eos). It exists so that
the demo, the tests and research code have a model whose MTP drafts are actually accepted.
It writes Python-looking code and nothing more.

- Corpus: the `*.py` files of CPython {pyver}'s standard library (test and site-packages
  folders excluded), sorted by path; every {heldout_every}th file is held out
  ({n_train} training files, {n_heldout} held out; {train_tokens:,} / {heldout_tokens:,} tokens).
  `prompts.json` holds prompts cut from held-out files.
- Training (`mtpjax.train`, docs/training.md): joint loss `CE(target) + {mtp_weights} *
  CE(MTP depths 1..{depths})`, regime `{regime}` (depth s uses module s % {mtp}), AdamW
  (lr {lr}, warmup + cosine), batch {batch} x {context} tokens, {steps} steps in {seconds:.0f} s on
  {device}.
- Reproduce (from the repository root; replaces this folder). `--seconds` makes the step count
  depend on the device; `--steps {steps}` repeats this run's schedule exactly:

      {command}

## Measured, teacher-forced (float32, {eval_windows} windows of {context} tokens per split)

{table}

"top-1" is accuracy against the real next token; "== target argmax" is how often the MTP
prediction equals the target's greedy token at the same position, i.e. greedy acceptance of
that draft position when the earlier drafts were accepted. Regime `multi_layer` feeds depth s
the previous depth's hidden state at the same position; `chain` the previous depth's output one
position earlier over target-derived context (docs/training.md).
{acceptance}
## License

Trained on CPython's standard library sources (Python Software Foundation License); the weights
and tokenizer are derived from them, and the prompts in `prompts.json` are excerpts of them.
"""

ACCEPTANCE = """
## Measured acceptance (speculative decoding, float32, {n_prompts} held-out prompts x {tokens} new tokens)

`mtpjax.eval_acceptance` (`mtpjax.generate`), greedy and sampled at temperature 1.0
(rejection sampling); the last column counts verify steps by tokens committed (1..K+1).

{table}
"""


def write_output(out: str, params, cfg, hf_config, tok, prompts, info, metrics, log,
                 acceptance) -> None:
    """Exports to a fresh folder beside `out`, then swaps it in (replacing `out`)."""
    from mtpjax.speculative.acceptance_eval import acceptance_table
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    stage = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.new-", dir=parent)
    new = os.path.join(stage, "model")
    try:
        assets = Assets(hf_config, {"tokenizer.json": tok.to_str().encode()})
        export_hf(new, params, cfg, assets=assets, dtype=jnp.bfloat16)
        with open(os.path.join(new, "prompts.json"), "w") as f:
            json.dump(prompts, f, indent=1)
        size = sum(os.path.getsize(os.path.join(new, n)) for n in os.listdir(new))
        info["size_mb"] = size / 1e6
        with open(os.path.join(new, "training.json"), "w") as f:
            json.dump({"info": info, "metrics": metrics, "log": log,
                       "acceptance": [dataclasses.asdict(r) for r in acceptance]}, f, indent=1)
        acc = "" if not acceptance else ACCEPTANCE.format(
            n_prompts=info["acceptance_prompts"], tokens=info["acceptance_tokens"],
            table=acceptance_table(acceptance))
        with open(os.path.join(new, "README.md"), "w") as f:
            f.write(README.format(table=summary_table(metrics), acceptance=acc,
                                  name=os.path.basename(out), **info))
        if os.path.lexists(out):
            os.rename(out, os.path.join(stage, "old"))
        os.rename(new, out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


# ---- main -------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default=sysconfig.get_paths()["stdlib"],
                    help="folder of *.py files (default: this interpreter's stdlib)")
    ap.add_argument("--out", required=True, help="output folder (replaced if it exists)")
    ap.add_argument("--steps", type=int, default=None, help="training steps (exact, reproducible)")
    ap.add_argument("--seconds", type=float, default=None,
                    help="wall-clock budget of the training loop (compile excluded)")
    ap.add_argument("--heldout-every", type=int, default=20)
    ap.add_argument("--vocab-size", type=int, default=768)
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--mtp-layers", type=int, default=1)
    ap.add_argument("--mtp-depths", type=int, default=2,
                    help="MTP depths trained (depth s uses module s %% mtp_layers)")
    ap.add_argument("--regime", choices=["multi_layer", "chain", "both"], default="multi_layer",
                    help="drafting regime the depths are trained in (docs/training.md)")
    ap.add_argument("--mtp-weight", type=float, default=0.5)
    ap.add_argument("--depth-decay", type=float, default=0.5)
    ap.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.05)
    ap.add_argument("--warmup", type=float, default=0.05, help="fraction of the run")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--eval-windows", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-chars", type=int, default=240,
                    help="max characters of a held-out prompt (prompt + completion must fit "
                         "in --context tokens)")
    ap.add_argument("--acceptance-table", choices=["auto", "on", "off"], default="auto",
                    help="measure speculative acceptance for the README (auto: when "
                         "--mtp-layers > 1)")
    ap.add_argument("--acceptance-tokens", type=int, default=64,
                    help="new tokens per held-out prompt in the acceptance table")
    ap.add_argument("--checkpoint-dir", default=None,
                    help="write Orbax training checkpoints here (with --checkpoint-every)")
    ap.add_argument("--checkpoint-every", type=int, default=None, help="steps between checkpoints")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=float, default=10.0, help="seconds between log lines")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                    help="a progress bar on stderr (needs rich)")
    args = ap.parse_args(argv)
    if args.steps is None and args.seconds is None:
        ap.error("give --steps and/or --seconds")
    if args.mtp_depths < 1 or args.mtp_layers < 1:
        ap.error("--mtp-layers and --mtp-depths must be >= 1")
    if not 0 <= args.warmup < 1:
        ap.error("--warmup is a fraction in [0, 1)")
    return args


def main(argv=None):
    from mtpjax.train.finetune import acceptance_rows
    args = parse_args(argv)
    command = "python -m mtpjax.train.tiny " + " ".join(sys.argv[1:] if argv is None else argv)
    t_start = time.perf_counter()
    device = jax.devices()[0]
    print(f"device: {device.platform} ({device.device_kind}); jax {jax.__version__}", flush=True)

    train_texts, heldout = read_corpus(args.corpus, args.heldout_every)
    tok = train_tokenizer(train_texts, args.vocab_size)
    eos_id = tok.token_to_id(EOS)
    train_stream = encode_stream(tok, train_texts, eos_id)
    heldout_stream = encode_stream(tok, [t for _, t in heldout], eos_id)
    n_chars = sum(len(t) for t in train_texts)
    print(f"corpus {args.corpus}: {len(train_texts)} training files ({len(train_stream):,} tokens, "
          f"{n_chars / len(train_stream):.2f} chars/token), {len(heldout)} held out "
          f"({len(heldout_stream):,} tokens); tokenizer {tok.get_vocab_size()} tokens "
          f"[{time.perf_counter() - t_start:.1f}s]", flush=True)

    cfg, hf_config = model_config(args, tok.get_vocab_size(), eos_id)
    params = mtpjax.init_params(cfg, jax.random.PRNGKey(args.seed), std=0.02)
    n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
    print(f"model: {n_params / 1e6:.2f} M parameters, {cfg}", flush=True)
    loss = LossConfig(depths=args.mtp_depths, regime=args.regime, mtp_weight=args.mtp_weight,
                      depth_decay=args.depth_decay)
    opt = adamw(args.lr, weight_decay=args.weight_decay, clip=args.clip)
    trainer = Trainer(cfg, loss, opt, trainable="all")
    state, frozen = trainer.init(params)
    length = loss.window_length(args.context)
    state, result = fit(
        trainer, state, frozen,
        lambda rng: sample_windows(train_stream, rng, args.batch_size, length),
        rng=np.random.default_rng(args.seed), steps=args.steps, seconds=args.seconds,
        lr=args.lr, warmup=args.warmup, min_lr_ratio=args.min_lr_ratio, log_every=args.log_every,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        progress=args.progress)
    params = trainer.params(state, frozen)

    # held-out metrics in both regimes (the chain regime needs gqa MTP blocks: these are)
    evaluator = Trainer(cfg, dataclasses.replace(loss, regime="both"), opt)
    metrics = {}
    for split, stream, seed in (("train", train_stream, 1), ("heldout", heldout_stream, 2)):
        m = evaluate_windows(evaluator, params,
                             fixed_windows(stream, args.eval_windows, length, seed), args.batch_size)
        metrics[split] = {"target_loss": m["target_loss"], "target_acc": m["target_acc"],
                          "regimes": list(evaluator.loss.regimes), "mtp_loss": m["mtp_loss"],
                          "mtp_acc": m["mtp_acc"], "mtp_agree_with_target": m["agree"]}
    prompts = heldout_prompts(heldout, args.num_prompts, max_chars=args.prompt_chars)
    acceptance = []
    if args.acceptance_table == "on" or (args.acceptance_table == "auto" and args.mtp_layers > 1):
        ids = [tok.encode(p["text"]).ids for p in prompts]
        acceptance = acceptance_rows(params, cfg, ids, list(range(1, max(3, args.mtp_layers) + 1)),
                                     args.acceptance_tokens, args.seed)
    info = dict(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                intermediate=args.intermediate, context=args.context, mtp=args.mtp_layers,
                depths=args.mtp_depths, regime=args.regime,
                params_m=n_params / 1e6, vocab=tok.get_vocab_size(),
                pyver=".".join(map(str, sys.version_info[:3])), heldout_every=args.heldout_every,
                n_train=len(train_texts), n_heldout=len(heldout),
                train_tokens=int(len(train_stream)), heldout_tokens=int(len(heldout_stream)),
                mtp_weights=str([round(w, 4) for w in loss.weights]), lr=args.lr,
                batch=args.batch_size, steps=result.steps, seconds=result.seconds,
                device=f"{device.platform} ({device.device_kind})", command=command,
                eval_windows=args.eval_windows, jax=jax.__version__, seed=args.seed,
                acceptance_prompts=len(prompts), acceptance_tokens=args.acceptance_tokens,
                flags=vars(args))
    host_params = jax.tree.map(np.asarray, params)
    write_output(args.out, host_params, cfg, hf_config, tok, prompts, info, metrics, result.log,
                 acceptance)
    print(f"\nwrote {args.out} ({info['size_mb']:.2f} MB) [{time.perf_counter() - t_start:.1f}s]")
    print(summary_table(metrics))
    if acceptance:
        from mtpjax.speculative.acceptance_eval import acceptance_table
        print(acceptance_table(acceptance))
    return metrics


if __name__ == "__main__":
    main()
