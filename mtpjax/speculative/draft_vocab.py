"""Draft vocabulary subset (FR-Spec, arXiv 2502.14856; EAGLE-3's reduced draft vocabulary).

Each MTP draft pass ends in the lm_head, [E, V]: at the Llama-3-8B shape 1.05 GB, two thirds of
a draft pass's bytes. With `SpecConfig(draft_vocab_size=N)` drafts are chosen among N token ids
(the most frequent ones of a corpus) through a head sliced once, [E, N], so a draft pass reads N
columns instead of V. Verification is untouched (full vocabulary), so output stays lossless:
the draft distribution q handed to rejection sampling is the draft's own distribution over the
subset, zero elsewhere, and the residual max(p - q, 0) covers every token q cannot propose.
Coupled acceptance stays exact too: the draft samples with the target's Gumbel noise over the
full vocabulary, restricted to the subset (docs/spec_decoding.md, "Draft vocabulary subset").

The ids are data (int32[N]), the size is static (`SpecConfig.draft_vocab_size`): one compiled
step serves any subset of that size. `with_draft_vocab` adds them to the params tree under
`params["draft_vocab"]` = {"ids": int32[N], "head": [E, N]}, a derived entry that `generate`
and `LLM` add and no checkpoint stores.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from mtpjax.config import ModelConfig, SpecConfig
from mtpjax.model.linear import linear
from mtpjax.model.params import lm_head_weight
from mtpjax.model.transformer import logits_from_hidden

KEY = "draft_vocab"
FILE = "draft_vocab.json"          # {"ranked_token_ids": [...], "source": "..."} in a model folder


def frequent_token_ids(tokens, vocab_size: int, always=()) -> np.ndarray:
    """Every token id 0..vocab_size-1 ranked by frequency in `tokens` (most frequent first, ties
    by id), with the ids in `always` (e.g. eos) moved to the front: the first N are the subset of
    size N. tokens: an int array or an iterable of int arrays (documents)."""
    counts = np.zeros(vocab_size, np.int64)
    chunks = [tokens] if isinstance(tokens, np.ndarray) else tokens
    for chunk in chunks:
        chunk = np.asarray(chunk, np.int64).ravel()
        if chunk.size and (chunk.min() < 0 or chunk.max() >= vocab_size):
            raise ValueError(f"token ids must be in [0, {vocab_size}), got "
                             f"[{chunk.min()}, {chunk.max()}]")
        counts += np.bincount(chunk, minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))
    first = [int(t) for t in dict.fromkeys(always)]
    for t in first:
        if not 0 <= t < vocab_size:
            raise ValueError(f"always-included id {t} is outside [0, {vocab_size})")
    rest = order[~np.isin(order, first)]
    return np.concatenate([np.asarray(first, np.int64), rest]).astype(np.int32)


def save_ranked_ids(folder: str, ranked: np.ndarray, source: str) -> str:
    path = os.path.join(folder, FILE)
    with open(path, "w") as f:
        json.dump({"ranked_token_ids": [int(t) for t in ranked], "source": source}, f)
    return path


def load_ranked_ids(folder: str) -> np.ndarray | None:
    """The ranked ids of a model folder's draft_vocab.json, or None when it has none."""
    path = os.path.join(folder, FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return np.asarray(json.load(f)["ranked_token_ids"], np.int32)


def check_ids(ids, cfg: ModelConfig, spec: SpecConfig) -> np.ndarray:
    """ids -> int32[N] host array, or ValueError naming what is wrong."""
    n = spec.draft_vocab_size
    arr = np.asarray(ids)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"draft_vocab must be a 1-D array of int token ids, got dtype "
                         f"{arr.dtype} shape {arr.shape}")
    if arr.shape[0] != n:
        raise ValueError(f"draft_vocab has {arr.shape[0]} ids; SpecConfig.draft_vocab_size is {n}")
    if arr.min() < 0 or arr.max() >= cfg.vocab_size:
        raise ValueError(f"draft_vocab ids must be in [0, {cfg.vocab_size}), got "
                         f"[{arr.min()}, {arr.max()}]")
    if np.unique(arr).size != n:
        raise ValueError("draft_vocab ids must be distinct")
    return arr.astype(np.int32)


def resolve_ids(cfg: ModelConfig, spec: SpecConfig | None, ids) -> np.ndarray | None:
    """The subset for this spec: None when it has no draft_vocab_size, else int32[N] host ids
    from `ids` (exactly N ids, or ranked ids of which the first N are taken); ValueError when
    they are missing or bad."""
    n = None if spec is None else spec.draft_vocab_size
    if n is None:
        if ids is not None:
            raise ValueError("draft_vocab ids were given but the SpecConfig has no "
                             "draft_vocab_size")
        return None
    if ids is None:
        raise ValueError(f"SpecConfig(draft_vocab_size={n}) needs the subset's token ids: pass "
                         "draft_vocab= (e.g. mtpjax.speculative.draft_vocab.frequent_token_ids "
                         f"over a corpus) or load a model folder with a {FILE}")
    arr = np.asarray(ids)
    if arr.ndim == 1 and arr.shape[0] > n:
        arr = arr[:n]
    return check_ids(arr, cfg, spec)


def attach(params, ids: np.ndarray | None, mesh=None):
    """params with `params["draft_vocab"]` for host ids int32[N] (without it for None). The
    head slice [E, N] is gathered here, once; under a mesh it is replicated."""
    params = {k: v for k, v in params.items() if k != KEY}
    if ids is None:
        return params
    ids_dev = jnp.asarray(ids)
    entry = {"ids": ids_dev, "head": jnp.take(lm_head_weight(params), ids_dev, axis=1)}
    if mesh is not None:
        from jax.sharding import NamedSharding, PartitionSpec as P
        entry = jax.device_put(entry, NamedSharding(mesh, P()))
    return {**params, KEY: entry}


def with_draft_vocab(params, cfg: ModelConfig, spec: SpecConfig | None, ids, mesh=None):
    """`attach(params, resolve_ids(cfg, spec, ids), mesh)`."""
    return attach(params, resolve_ids(cfg, spec, ids), mesh)


def draft_logits(params, normed: jax.Array):
    """normed [R, E] -> (f32 logits [R, N or V], ids int32[N] or None): over the draft subset
    when the params carry one, else over the whole vocabulary."""
    entry = params.get(KEY)
    if entry is None:
        return logits_from_hidden(params, normed), None
    return linear(normed, entry["head"]).astype(jnp.float32), entry["ids"]


def main(argv=None):
    """`python -m mtpjax.speculative.draft_vocab --model FOLDER`: rank a model folder's token ids
    by frequency over a corpus of *.py files (the training split: every `--heldout-every`-th
    file is left out, as `mtpjax.train.tiny` splits) and write FOLDER/draft_vocab.json."""
    import argparse
    import sysconfig

    from tokenizers import Tokenizer

    from mtpjax.train.data import read_corpus

    ap = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="folder with config.json and tokenizer.json")
    ap.add_argument("--corpus", default=sysconfig.get_paths()["stdlib"])
    ap.add_argument("--heldout-every", type=int, default=20)
    args = ap.parse_args(argv)
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    tok = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    train, _ = read_corpus(args.corpus, args.heldout_every)
    eos = tok.token_to_id("<|endoftext|>")
    ranked = frequent_token_ids((np.asarray(e.ids, np.int64) for e in tok.encode_batch(train)),
                                vocab, always=() if eos is None else (eos,))
    import platform
    corpus = (f"CPython {platform.python_version()}'s standard library"
              if args.corpus == sysconfig.get_paths()["stdlib"] else args.corpus)
    source = (f"token counts over the training split of {corpus} (*.py, every "
              f"{args.heldout_every}th file held out; {len(train)} files), eos first")
    path = save_ranked_ids(args.model, ranked, source)
    print(f"wrote {path}: {vocab} ranked ids; {source}")


if __name__ == "__main__":
    main()
