"""`python -m mtpjax.train.tiny`: train the tiny MiMo-style code model shipped with mtpjax.

A Qwen2 target plus `num_mtp_layers` MTP module(s) (model_type "mimo", so it loads through the
MiMo path of `mtpjax.checkpoint.load_hf`), trained jointly on Python source files:

    loss = CE(target, x_{i+1}) + w * sum_d decay^d * CE(depth d, x_{i+d+2})

Depth d (0-based) runs module `d % D` (D = num_mtp_layers) at position i on the previous depth's
hidden state h^d_i (h^0 = the target's final-normed hidden state) and token x_{i+d+1}, exactly
as `mtpjax.mtp_forward` and the from-scratch references in the tests chain modules. With
`--mtp-depths 2` and one module, the module is also trained on its own output hidden state,
which is what chain drafting with K >= 2 feeds it.

Everything is reproducible from the flags: files sorted by path, every `--heldout-every`-th file
held out, a byte-level BPE tokenizer trained on the training files, fixed seeds, and a
deterministic window order. `--seconds` is a wall-clock budget for the training loop (the
learning-rate schedule follows elapsed time then, so the step count depends on the device;
it is printed, and `--steps N` alone reproduces a run exactly).

The output folder (replaced if it exists) is a Hugging Face folder written by
`mtpjax.checkpoint.export_hf` (config.json, model.safetensors in bf16, tokenizer.json), plus
`prompts.json` (held-out prompts for the demo and tests), `training.json` (flags and metrics)
and a README.md with the measured numbers. `mtpjax.LLM.from_pretrained(out)` loads it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import shutil
import sys
import sysconfig
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mtpjax
from mtpjax.checkpoint import Assets, export_hf
from mtpjax.config import ModelConfig

EOS = "<|endoftext|>"
EXCLUDED_DIRS = ("site-packages", "dist-packages", "test", "tests", "__pycache__")


# ---- corpus and tokenizer ---------------------------------------------------------------------

def list_files(root: str) -> list[str]:
    """`*.py` under root, sorted by relative path, skipping test and third-party folders."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        out += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(out, key=lambda p: os.path.relpath(p, root))


def read_corpus(root: str, heldout_every: int):
    """(train texts, held-out [(relpath, text)]): file i is held out when i % heldout_every == 0."""
    train, heldout = [], []
    for i, path in enumerate(list_files(root)):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        (heldout.append((os.path.relpath(path, root), text)) if i % heldout_every == 0
         else train.append(text))
    if not train or not heldout:
        raise SystemExit(f"corpus {root}: need training and held-out files, got {len(train)} / "
                         f"{len(heldout)} (*.py files, every {heldout_every}th held out)")
    return train, heldout


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (any text round-trips), special token <|endoftext|> = id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def encode_stream(tok, texts: list[str]) -> np.ndarray:
    """One int32 stream: each file's tokens followed by <|endoftext|>."""
    eos = tok.token_to_id(EOS)
    parts = []
    for enc in tok.encode_batch(texts):
        parts.append(np.asarray(enc.ids, np.int32))
        parts.append(np.asarray([eos], np.int32))
    return np.concatenate(parts)


def heldout_prompts(heldout, n: int, max_chars: int) -> list[dict]:
    """Prompts cut from held-out files at line boundaries (one per file, from its middle)."""
    out = []
    for rel, text in heldout:
        lines = text.splitlines(keepends=True)
        if len(lines) < 20:
            continue
        start = len(lines) // 2
        while start < len(lines) and not lines[start].strip():
            start += 1
        chunk = ""
        for ln in lines[start:]:
            if len(chunk) + len(ln) > max_chars:
                break
            chunk += ln
        if chunk.strip():
            out.append({"file": rel, "text": chunk})
        if len(out) == n:
            break
    return out


# ---- model and loss ---------------------------------------------------------------------------

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


def _ce_and_acc(logits, labels):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    ce = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    pred = jnp.argmax(logits, axis=-1)
    return ce.mean(), (pred == labels).mean(), pred


def losses(params, cfg: ModelConfig, batch, context: int, depths: int):
    """batch int32[B, context + depths + 1] -> (target (ce, acc, pred), [(ce, acc, pred)] per depth)."""
    x = batch[:, :context]
    logits, h = mtpjax.forward(params, cfg, x, return_hidden=True)
    target = _ce_and_acc(logits, batch[:, 1:context + 1])
    heads = []
    for d in range(depths):                 # depth d at position i: (h^d_i, x_{i+d+1}) -> x_{i+d+2}
        h, lg = mtpjax.mtp_forward(params, cfg, d % cfg.num_mtp_layers, h,
                                   batch[:, d + 1:d + 1 + context])
        heads.append(_ce_and_acc(lg, batch[:, d + 2:d + 2 + context]))
    return target, heads


def mtp_weights(args) -> list[float]:
    return [args.mtp_weight * args.depth_decay ** d for d in range(args.mtp_depths)]


def make_steps(cfg: ModelConfig, args):
    weights = mtp_weights(args)
    opt = optax.chain(
        optax.clip_by_global_norm(args.clip),
        optax.inject_hyperparams(optax.adamw)(learning_rate=args.lr, b1=0.9, b2=0.95,
                                              weight_decay=args.weight_decay))

    def loss_fn(params, batch):
        (t_ce, _, _), heads = losses(params, cfg, batch, args.context, args.mtp_depths)
        total = t_ce + sum(w * ce for w, (ce, _, _) in zip(weights, heads))
        return total, (t_ce, jnp.stack([ce for ce, _, _ in heads]))

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, batch, lr):
        clip_state, adam_state = opt_state
        adam_state = adam_state._replace(
            hyperparams={**adam_state.hyperparams, "learning_rate": lr})
        opt_state = (clip_state, adam_state)
        (total, (t_ce, m_ce)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, total, t_ce, m_ce

    @jax.jit
    def eval_step(params, batch):
        (t_ce, t_acc, t_pred), heads = losses(params, cfg, batch, args.context, args.mtp_depths)
        # agreement of each depth's argmax with the target's argmax at the same future position:
        # what greedy acceptance checks (depth d's x_{i+d+2} vs the target at position i+d+1)
        agree = [(pred[:, :args.context - d - 1] == t_pred[:, d + 1:]).mean()
                 for d, (_, _, pred) in enumerate(heads)]
        return (t_ce, t_acc, jnp.stack([ce for ce, _, _ in heads]),
                jnp.stack([acc for _, acc, _ in heads]), jnp.stack(agree))

    return opt, train_step, eval_step


def lr_at(progress: float, args) -> float:
    """Linear warmup over `--warmup` of the run, then cosine to `--min-lr-ratio` * lr."""
    p = min(max(progress, 0.0), 1.0)
    if p < args.warmup:
        return args.lr * p / args.warmup
    c = 0.5 * (1 + math.cos(math.pi * (p - args.warmup) / (1 - args.warmup)))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * c)


def windows(stream: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
    return stream[starts[:, None] + np.arange(length)[None, :]]


def evaluate(eval_step, params, stream, args, num_windows: int, seed: int) -> dict:
    """Mean metrics over fixed windows of `stream` (same windows every call)."""
    length = args.context + args.mtp_depths + 1
    rng = np.random.default_rng(seed)
    starts = np.sort(rng.integers(0, len(stream) - length, size=num_windows))
    acc = None
    n = 0
    for i in range(0, num_windows, args.batch_size):
        b = windows(stream, starts[i:i + args.batch_size], length)
        if len(b) < args.batch_size:      # keep one compiled shape
            b = np.concatenate([b, b[: args.batch_size - len(b)]])
        out = [np.asarray(x, np.float64) for x in eval_step(params, jnp.asarray(b))]
        acc = out if acc is None else [a + o for a, o in zip(acc, out)]
        n += 1
    t_ce, t_acc, m_ce, m_acc, agree = [a / n for a in acc]
    return {"target_loss": float(t_ce), "target_acc": float(t_acc),
            "mtp_loss": [float(x) for x in m_ce], "mtp_acc": [float(x) for x in m_acc],
            "mtp_agree_with_target": [float(x) for x in agree]}


# ---- output -----------------------------------------------------------------------------------

def summary_table(metrics: dict) -> str:
    rows = ["| split | target loss | target top-1 | " + " | ".join(
        f"MTP depth {d + 1} loss | MTP depth {d + 1} top-1 | depth {d + 1} == target argmax"
        for d in range(len(metrics["train"]["mtp_loss"]))) + " |"]
    rows.append("|" + "---|" * (3 + 3 * len(metrics["train"]["mtp_loss"])))
    for split in ("train", "heldout"):
        m = metrics[split]
        cells = [split, f"{m['target_loss']:.3f}", f"{m['target_acc']:.3f}"]
        for d in range(len(m["mtp_loss"])):
            cells += [f"{m['mtp_loss'][d]:.3f}", f"{m['mtp_acc'][d]:.3f}",
                      f"{m['mtp_agree_with_target'][d]:.3f}"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


README = """# tiny_code_mimo: a tiny trained target + MTP model

A {size_mb:.1f} MB MiMo-style checkpoint (Hugging Face folder, model_type `mimo`: a Qwen2 target
with {layers} layers, hidden {hidden}, {heads} heads ({kv_heads} KV), intermediate {intermediate},
context {context}, plus {mtp} MTP module(s); {params_m:.2f} M parameters stored in bfloat16) and
its byte-level BPE tokenizer ({vocab} tokens, `<|endoftext|>` = id 0 = eos). It exists so that
`python -m mtpjax.demo`, `tests/test_tiny_model.py` and `mtpjax.assets.tiny_model_path()` have a
model whose MTP drafts are actually accepted. It writes Python-looking code and nothing more.

- Corpus: the `*.py` files of CPython {pyver}'s standard library (test and site-packages
  folders excluded), sorted by path; every {heldout_every}th file is held out
  ({n_train} training files, {n_heldout} held out; {train_tokens:,} / {heldout_tokens:,} tokens).
  `prompts.json` holds prompts cut from held-out files.
- Training: joint loss `CE(target) + {mtp_weights} * CE(MTP depths)` (the single module is also
  trained on its own hidden state at depth 2, as chain drafting with K >= 2 uses it), AdamW
  (lr {lr}, warmup + cosine), batch {batch} x {context} tokens, {steps} steps in {seconds:.0f} s on
  {device}.
- Reproduce (from the repository root; replaces this folder):

      {command}

## Measured (float32, {eval_windows} windows of {context} tokens per split)

{table}

"top-1" is accuracy against the real next token; "== target argmax" is how often the MTP
prediction equals the target's greedy token at the same position, i.e. greedy acceptance of
that draft position when the earlier drafts were accepted.

## License

Trained on CPython's standard library sources (Python Software Foundation License); the weights
and tokenizer are derived from them, and the prompts in `prompts.json` are excerpts of them.
"""


def write_output(out: str, params, cfg, hf_config, tok, prompts, info, metrics) -> None:
    """Exports to a fresh folder beside `out`, then swaps it in (replacing `out`)."""
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
            json.dump({"info": info, "metrics": metrics}, f, indent=1)
        with open(os.path.join(new, "README.md"), "w") as f:
            f.write(README.format(table=summary_table(metrics), **info))
        old = None
        if os.path.lexists(out):
            old = os.path.join(stage, "old")
            os.rename(out, old)
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
                    help="MTP depths trained (depth d uses module d %% mtp_layers)")
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
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=float, default=10.0, help="seconds between progress lines")
    args = ap.parse_args(argv)
    if args.steps is None and args.seconds is None:
        ap.error("give --steps and/or --seconds")
    if args.mtp_depths < 1 or args.mtp_layers < 1:
        ap.error("--mtp-layers and --mtp-depths must be >= 1")
    if not 0 <= args.warmup < 1:
        ap.error("--warmup is a fraction in [0, 1)")
    return args


def main(argv=None):
    args = parse_args(argv)
    command = "python -m mtpjax.train.tiny " + " ".join(sys.argv[1:] if argv is None else argv)
    t_start = time.perf_counter()
    device = jax.devices()[0]
    print(f"device: {device.platform} ({device.device_kind}); jax {jax.__version__}", flush=True)

    train_texts, heldout = read_corpus(args.corpus, args.heldout_every)
    tok = train_tokenizer(train_texts, args.vocab_size)
    eos_id = tok.token_to_id(EOS)
    train_stream = encode_stream(tok, train_texts)
    heldout_stream = encode_stream(tok, [t for _, t in heldout])
    n_chars = sum(len(t) for t in train_texts)
    print(f"corpus {args.corpus}: {len(train_texts)} training files ({len(train_stream):,} tokens, "
          f"{n_chars / len(train_stream):.2f} chars/token), {len(heldout)} held out "
          f"({len(heldout_stream):,} tokens); tokenizer {tok.get_vocab_size()} tokens "
          f"[{time.perf_counter() - t_start:.1f}s]", flush=True)

    cfg, hf_config = model_config(args, tok.get_vocab_size(), eos_id)
    params = mtpjax.init_params(cfg, jax.random.PRNGKey(args.seed), std=0.02)
    n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
    print(f"model: {n_params / 1e6:.2f} M parameters, {cfg}", flush=True)
    opt, train_step, eval_step = make_steps(cfg, args)
    opt_state = opt.init(params)

    length = args.context + args.mtp_depths + 1
    rng = np.random.default_rng(args.seed)
    step, t_train, last_log = 0, None, 0.0
    while True:
        if t_train is not None:
            elapsed = time.perf_counter() - t_train
            progress = max(step / args.steps if args.steps else 0.0,
                           elapsed / args.seconds if args.seconds else 0.0)
            if progress >= 1.0:
                break
        else:
            elapsed, progress = 0.0, 0.0
        starts = rng.integers(0, len(train_stream) - length, size=args.batch_size)
        batch = jnp.asarray(windows(train_stream, starts, length))
        params, opt_state, total, t_ce, m_ce = train_step(params, opt_state, batch,
                                                          jnp.float32(lr_at(progress, args)))
        step += 1
        if t_train is None:          # the first step compiles: the budget starts after it
            jax.block_until_ready(total)
            t_train = time.perf_counter()
            print(f"compiled train step [{t_train - t_start:.1f}s]", flush=True)
        elif elapsed - last_log >= args.log_every:
            last_log = elapsed
            m = np.asarray(m_ce)
            print(f"step {step:6d}  {elapsed:7.1f}s  lr {lr_at(progress, args):.2e}  loss "
                  f"{float(total):.3f}  target {float(t_ce):.3f}  mtp "
                  f"{' '.join(f'{x:.3f}' for x in m)}  "
                  f"{(step - 1) * args.batch_size * args.context / max(elapsed, 1e-9):,.0f} tok/s",
                  flush=True)
    jax.block_until_ready(params)
    train_seconds = time.perf_counter() - t_train
    print(f"trained {step} steps in {train_seconds:.1f}s", flush=True)

    metrics = {"train": evaluate(eval_step, params, train_stream, args, args.eval_windows, 1),
               "heldout": evaluate(eval_step, params, heldout_stream, args, args.eval_windows, 2)}
    info = dict(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                intermediate=args.intermediate, context=args.context, mtp=args.mtp_layers,
                params_m=n_params / 1e6, vocab=tok.get_vocab_size(),
                pyver=".".join(map(str, sys.version_info[:3])), heldout_every=args.heldout_every,
                n_train=len(train_texts), n_heldout=len(heldout),
                train_tokens=int(len(train_stream)), heldout_tokens=int(len(heldout_stream)),
                mtp_weights=str([round(w, 4) for w in mtp_weights(args)]), lr=args.lr,
                batch=args.batch_size, steps=step, seconds=train_seconds,
                device=f"{device.platform} ({device.device_kind})", command=command,
                eval_windows=args.eval_windows, jax=jax.__version__, seed=args.seed)
    prompts = heldout_prompts(heldout, args.num_prompts, max_chars=args.prompt_chars)
    host_params = jax.tree.map(np.asarray, params)
    write_output(args.out, host_params, cfg, hf_config, tok, prompts, info, metrics)
    print(f"\nwrote {args.out} ({info['size_mb']:.2f} MB) [{time.perf_counter() - t_start:.1f}s]")
    print(summary_table(metrics))
    return metrics


if __name__ == "__main__":
    main()
