"""MTP-head fine-tuning on a frozen target: `finetune_mtp` and `python -m mtpjax.train.finetune`.

Only the MTP modules' params get gradients; the target (embedding and lm_head included, which
the modules share) stays bit-identical. The default labels are the target's own next-token
distributions (self-distillation, `labels="target_kl"`; `"target_greedy"` uses its argmax
tokens), because acceptance is measured against the target, not against the data.

The CLI (`mtpjax finetune`, or `python -m mtpjax.train.finetune`) fine-tunes a model folder's heads on the corpus it was trained on (training.json's
corpus split when present, so held-out files stay held out), measures acceptance on the
held-out prompts (`prompts.json`) before and after, and writes a Hugging Face folder
(`export_hf`) with `finetune.json` (flags, log, acceptance before / after).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np

from mtpjax.config import ModelConfig, SpecConfig
from mtpjax.model.params import init_params
from mtpjax.train.loop import FitResult, fit
from mtpjax.train.loss import LossConfig
from mtpjax.train.step import Trainer, adamw


def finetune_mtp(params, cfg: ModelConfig, sample, *, rng: np.random.Generator,
                 loss: LossConfig | None = None, steps: int | None = None,
                 seconds: float | None = None, lr: float = 1e-3, weight_decay: float = 0.0,
                 warmup: float = 0.05, min_lr_ratio: float = 0.1, mesh=None,
                 **fit_kwargs) -> tuple[dict, FitResult]:
    """Fine-tunes params["mtp"] on a frozen target -> (params, FitResult).

    sample(rng) -> host windows int32[B, T + depths + 1]. loss: default self-distillation (KL to
    the target) of `num_mtp_layers` depths in the chain regime, target_weight 0. A loss with
    target_weight > 0 is refused (the target is frozen). fit_kwargs go to `mtpjax.train.fit`
    (log_every, evaluate, eval_every, checkpoint_dir, progress, ...).
    """
    if loss is None:
        loss = LossConfig(depths=cfg.num_mtp_layers, regime="chain", labels="target_kl",
                          target_weight=0.0)
    if loss.target_weight != 0:
        raise ValueError(f"fine-tuning freezes the target: LossConfig.target_weight must be 0, "
                         f"got {loss.target_weight}")
    trainer = Trainer(cfg, loss, adamw(lr, weight_decay=weight_decay), trainable="mtp", mesh=mesh)
    state, frozen = trainer.init(params)
    state, result = fit(trainer, state, frozen, sample, rng=rng, steps=steps, seconds=seconds,
                        lr=lr, warmup=warmup, min_lr_ratio=min_lr_ratio, **fit_kwargs)
    return trainer.params(state, frozen), result


def reinit_mtp(params, cfg: ModelConfig, seed: int, std: float = 0.02):
    """params with freshly initialized MTP modules (the target untouched)."""
    fresh = init_params(cfg, jax.random.PRNGKey(seed), dtype=params["embed"].dtype, std=std)
    return {**params, "mtp": fresh["mtp"]}


# ---- CLI --------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", required=True, help="model folder (Hugging Face or Orbax)")
    ap.add_argument("--out", required=True, help="output Hugging Face folder (must not exist)")
    ap.add_argument("--corpus", default=None,
                    help="folder of *.py files (default: training.json's, else this stdlib)")
    ap.add_argument("--heldout-every", type=int, default=None,
                    help="held-out split of the corpus (default: training.json's, else 20)")
    ap.add_argument("--max-files", type=int, default=None,
                    help="read only the first N files (default: all)")
    ap.add_argument("--steps", type=int, default=None,
                    help="train steps (with --seconds: whichever ends first)")
    ap.add_argument("--seconds", type=float, default=None,
                    help="training time; loading, compiling and the acceptance tables before and "
                         "after come on top (minutes on a CPU)")
    ap.add_argument("--labels", choices=["target_kl", "target_greedy", "data"], default="target_kl",
                    help="what the heads learn: the target's distributions (KL), its argmax "
                         "tokens, or the data")
    ap.add_argument("--regime", choices=["multi_layer", "chain", "both"], default="chain",
                    help="drafting regime trained (chain: module 0 reused at every depth)")
    ap.add_argument("--depths", type=int, default=None, help="depths trained (default: num_mtp_layers)")
    ap.add_argument("--mtp-weight", type=float, default=1.0, help="weight of the MTP loss")
    ap.add_argument("--depth-decay", type=float, default=0.5,
                    help="loss weight of depth d is depth_decay ** d")
    ap.add_argument("--reinit-mtp", type=int, default=None, metavar="SEED",
                    help="start from freshly initialized MTP modules (a from-scratch head)")
    ap.add_argument("--context", type=int, default=256, help="tokens per training window")
    ap.add_argument("--batch-size", type=int, default=32, help="windows per train step")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW)")
    ap.add_argument("--eval-k", type=int, nargs="+", default=None,
                    help="K values of the chain acceptance table (default 1..max(3, D))")
    ap.add_argument("--eval-prompts", type=int, default=16,
                    help="held-out prompts of the acceptance tables")
    ap.add_argument("--max-new-tokens", type=int, default=64,
                    help="new tokens per prompt in the acceptance tables")
    ap.add_argument("--seed", type=int, default=0, help="seed of sampling and the data order")
    ap.add_argument("--log-every", type=float, default=10.0, help="seconds between log lines")
    args = ap.parse_args(argv)
    if args.steps is None and args.seconds is None:
        ap.error("give --steps and/or --seconds")
    return args


def acceptance_rows(params, cfg, prompts, ks, max_new_tokens, seed, temperatures=(0.0, 1.0)):
    """Acceptance results for chain at each K in ks, and multi_layer at each K <= D in ks."""
    from mtpjax.speculative.acceptance_eval import eval_acceptance
    runs = [("chain", k) for k in ks] + [("multi_layer", k) for k in ks
                                         if k <= cfg.num_mtp_layers]
    rows = []
    for method, k in runs:
        res = eval_acceptance(params, cfg, SpecConfig(num_speculative_tokens=k, method=method),
                              prompts, max_new_tokens=max_new_tokens, temperatures=temperatures,
                              seed=seed)
        rows += list(res.values())
    return rows


def main(argv=None):
    from tokenizers import Tokenizer as HFTokenizer

    from mtpjax.checkpoint import export_hf, load_pretrained
    from mtpjax.demo import waiting
    from mtpjax.speculative.acceptance_eval import acceptance_table
    from mtpjax.train.data import EOS, encode_stream, read_corpus, sample_windows

    args = parse_args(argv)
    # finetune.json records how to rerun this: `mtpjax finetune` runs main() with that prog
    prog = "mtpjax finetune" if sys.argv[0] == "mtpjax finetune" else "python -m mtpjax.train.finetune"
    command = prog + " " + " ".join(sys.argv[1:] if argv is None else argv)
    t0 = time.perf_counter()
    with waiting(f"loading {args.model}"):
        ckpt = load_pretrained(args.model, jnp.float32, fp8="dequantize")   # trains float32
    cfg, params = ckpt.cfg, ckpt.params
    if "tokenizer.json" not in ckpt.assets.files:
        raise SystemExit(f"{args.model} has no tokenizer.json (needed to encode the corpus)")
    tok = HFTokenizer.from_str(ckpt.assets.files["tokenizer.json"].decode())
    trained = {}
    if os.path.isfile(os.path.join(args.model, "training.json")):
        with open(os.path.join(args.model, "training.json")) as f:
            trained = json.load(f).get("info", {})
    corpus = args.corpus or trained.get("corpus") or sysconfig.get_paths()["stdlib"]
    heldout_every = args.heldout_every or trained.get("heldout_every", 20)
    with waiting(f"reading and tokenizing {corpus}"):
        train_texts, heldout = read_corpus(corpus, heldout_every, args.max_files)
        eos = tok.token_to_id(EOS)
        stream = encode_stream(tok, train_texts, 0 if eos is None else eos)
    prompt_file = os.path.join(args.model, "prompts.json")
    if os.path.isfile(prompt_file):
        with open(prompt_file) as f:
            texts = [p["text"] for p in json.load(f)]
    else:
        from mtpjax.train.data import heldout_prompts
        texts = [p["text"] for p in heldout_prompts(heldout, args.eval_prompts, 240)]
    prompts = [tok.encode(t).ids for t in texts[:args.eval_prompts]]
    print(f"{args.model}: {cfg.num_mtp_layers} MTP module(s); corpus {corpus}: "
          f"{len(stream):,} training tokens; {len(prompts)} held-out prompts "
          f"[{time.perf_counter() - t0:.1f}s]", flush=True)

    if args.reinit_mtp is not None:
        params = reinit_mtp(params, cfg, args.reinit_mtp)
    ks = args.eval_k or list(range(1, max(3, cfg.num_mtp_layers) + 1))
    with waiting(f"acceptance before, K in {ks} (compiles a generate loop per K and method)"):
        before = acceptance_rows(params, cfg, prompts, ks, args.max_new_tokens, args.seed)
    print("acceptance before:\n" + acceptance_table(before), flush=True)

    depths = args.depths or cfg.num_mtp_layers
    loss = LossConfig(depths=depths, regime=args.regime, labels=args.labels,
                      mtp_weight=args.mtp_weight, depth_decay=args.depth_decay, target_weight=0.0)
    length = loss.window_length(args.context)
    rng = np.random.default_rng(args.seed)
    print(f"training for {args.seconds or '-'} s / {args.steps or '-'} steps (the first step "
          "compiles)", file=sys.stderr, flush=True)
    params, result = finetune_mtp(
        params, cfg, lambda r: sample_windows(stream, r, args.batch_size, length), rng=rng,
        loss=loss, steps=args.steps, seconds=args.seconds, lr=args.lr, log_every=args.log_every)
    with waiting("acceptance after"):
        after = acceptance_rows(params, cfg, prompts, ks, args.max_new_tokens, args.seed)
    print("acceptance after:\n" + acceptance_table(after), flush=True)

    info = {"command": command, "model": args.model, "corpus": corpus,
            "heldout_every": heldout_every, "loss": dataclasses.asdict(loss),
            "steps": result.steps, "seconds": result.seconds, "lr": args.lr,
            "batch": args.batch_size, "context": args.context,
            "device": f"{jax.devices()[0].platform} ({jax.devices()[0].device_kind})"}
    with waiting(f"writing {args.out}"):
        host = jax.tree.map(np.asarray, params)
        export_hf(args.out, host, cfg, assets=ckpt.assets, dtype=jnp.bfloat16)
    with open(os.path.join(args.out, "finetune.json"), "w") as f:
        json.dump({"info": info, "log": result.log,
                   "acceptance_before": [dataclasses.asdict(r) for r in before],
                   "acceptance_after": [dataclasses.asdict(r) for r in after]}, f, indent=1)
    if os.path.isfile(prompt_file):
        with open(prompt_file) as f, open(os.path.join(args.out, "prompts.json"), "w") as g:
            g.write(f.read())
    print(f"wrote {args.out} [{time.perf_counter() - t0:.1f}s]", flush=True)
    return before, after


if __name__ == "__main__":
    main()
