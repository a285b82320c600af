"""Training data from a folder of source files: the corpus split, a byte-level BPE tokenizer,
token streams and the fixed-length windows a train step consumes.

Everything is deterministic: files sorted by relative path, every `heldout_every`-th file held
out (file i is held out when i % heldout_every == 0), windows drawn by a seeded numpy Generator.
"""

from __future__ import annotations

import os

import numpy as np

EOS = "<|endoftext|>"
EXCLUDED_DIRS = ("site-packages", "dist-packages", "test", "tests", "__pycache__")


def list_files(root: str) -> list[str]:
    """`*.py` under root, sorted by relative path, skipping test and third-party folders."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        out += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(out, key=lambda p: os.path.relpath(p, root))


def read_corpus(root: str, heldout_every: int, max_files: int | None = None):
    """(train texts, held-out [(relpath, text)]): file i is held out when i % heldout_every == 0.

    max_files: read only the first `max_files` files of the sorted list (quick runs, tests).
    """
    if heldout_every < 2:
        raise ValueError(f"heldout_every must be >= 2 (every n-th file held out), got {heldout_every}")
    train, heldout = [], []
    for i, path in enumerate(list_files(root)[:max_files]):
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
        raise ValueError(f"corpus {root}: need training and held-out files, got {len(train)} / "
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


def encode_stream(tok, texts: list[str], eos_id: int) -> np.ndarray:
    """One int32 stream: each file's tokens followed by eos. tok: a `tokenizers.Tokenizer`."""
    parts = []
    for enc in tok.encode_batch(texts):
        parts.append(np.asarray(enc.ids, np.int32))
        parts.append(np.asarray([eos_id], np.int32))
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


def windows(stream: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
    """int32[len(starts), length]: stream[s : s + length] for each start s."""
    return stream[np.asarray(starts)[:, None] + np.arange(length)[None, :]]


def sample_windows(stream: np.ndarray, rng: np.random.Generator, batch_size: int,
                   length: int) -> np.ndarray:
    """int32[batch_size, length] windows at uniform random starts (one rng draw per batch)."""
    if len(stream) <= length:
        raise ValueError(f"the token stream has {len(stream)} tokens; windows of {length} need more")
    return windows(stream, rng.integers(0, len(stream) - length, size=batch_size), length)


def fixed_windows(stream: np.ndarray, num: int, length: int, seed: int) -> np.ndarray:
    """int32[num, length]: the same sorted random windows for a given seed (evaluation sets)."""
    if len(stream) <= length:
        raise ValueError(f"the token stream has {len(stream)} tokens; windows of {length} need more")
    starts = np.sort(np.random.default_rng(seed).integers(0, len(stream) - length, size=num))
    return windows(stream, starts, length)
