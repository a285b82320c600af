"""Engine warm-up: the step buckets an engine can reach, and compiling them at start-up with a
progress display (`LLM(..., warmup=True)`, `warm_up`, `ModelRunner.warmup`).

A step is compiled once per (T, F): T = bucketed query tokens, F = bucketed MTP first-pass
length (both `bucket_size`, powers of two >= the engine's min_token_bucket, 8 by default;
rows, block-table width and everything else are
fixed per engine). The scheduler puts S <= max_num_batched_tokens query tokens in at most
max_num_seqs rows: a decode row has K + 1 tokens, a prefill chunk 1..S. The runner's first pass
(`ModelRunner.pack`) takes max(W, q) entries per row (W = first-pass window, 1 without
speculation; a decode's K + 1 <= W), so for S tokens in m rows

    first_pass >= max(W, S)                               (one row)
    first_pass <= (m - 1) * W + max(W, S - m + 1)         (m - 1 one-token chunks + one row)

and every value in between is reachable up to gaps smaller than a bucket. With chain drafting
a decode row is as wide as the drafts it verifies (1..K+1 tokens, as many first-pass entries),
so a step of decodes only also reaches first_pass = S. Each T bucket covers
S in (T/2, T] (S in 1..8 for T = 8); its F buckets run from bucket(max(W, S_min)) to
bucket((m - 1) W + max(W, S_max - m + 1)) with m = min(max_num_seqs, S_max).
`tests/engine/test_warmup.py` checks this against brute force over all row mixes.
"""

from __future__ import annotations

import os
import sys
import time

from mtpjax.generate import MIN_TOKEN_BUCKET, bucket_size


def step_buckets(max_num_batched_tokens: int, max_num_seqs: int, window: int,
                 minimum: int = MIN_TOKEN_BUCKET, decode_tokens: int | None = None
                 ) -> list[tuple[int, int]]:
    """Every (T, F) step shape an engine with these limits can dispatch, sorted. minimum: the
    smallest bucket (the engine's min_token_bucket). decode_tokens: a decode row's most tokens
    when the runner packs decode rows as wide as their drafts (`ModelRunner.decode_tokens`:
    1..K+1 tokens and as many first-pass entries); None: decode rows count as chunks."""
    B, R, W = max_num_batched_tokens, max_num_seqs, window
    out = []
    T = bucket_size(1, minimum)
    while True:
        lo, hi = (1 if T == bucket_size(1, minimum) else T // 2 + 1), min(T, B)
        if lo > hi:
            return sorted(out)
        m = min(R, hi)
        F = bucket_size(max(W, lo), minimum)
        f_hi = bucket_size((m - 1) * W + max(W, hi - m + 1), minimum)
        found = set()
        while F <= f_hi:
            found.add(F)
            F *= 2
        if decode_tokens and lo <= R * decode_tokens:
            # decode rows only: F = S (a row with a chunk has F >= W, counted above)
            F = bucket_size(lo, minimum)
            while F <= bucket_size(min(hi, R * decode_tokens), minimum):
                found.add(F)
                F *= 2
        out += [(T, F) for F in sorted(found)]
        T *= 2


def warm_up(runner, max_num_batched_tokens: int, max_num_seqs: int,
            times: list[tuple[int, int, float]]) -> None:
    """Compiles (or loads from the runner's executable store) the step of every bucket an engine
    with these limits can reach; appends (T, F, seconds) to `times` as each is done."""
    buckets = step_buckets(max_num_batched_tokens, max_num_seqs, runner.W, runner.min_bucket,
                           runner.decode_tokens)
    threads = int(os.environ.get("MTPJAX_WARMUP_THREADS", min(4, os.cpu_count() or 1)))
    # loading a stored executable is file reading and GPU module loading, not compiling:
    # more of them at once (measured at the 8B shape: 44 programs, 4 threads -> 14.6 s)
    load_threads = max(threads, min(16, os.cpu_count() or 1))
    with WarmupProgress(len(buckets)) as bar:
        def done(T, F, seconds):
            times.append((T, F, seconds))
            bar.update(T, F, seconds)
        runner.warmup(buckets, on_compiled=done, threads=threads, load_threads=load_threads)
    store = runner.store
    if store is not None and store.hits:
        print(f"warm-up: {store.hits} step programs loaded from the executable store "
              f"{store.folder} ({runner.load_seconds:.1f} s, {load_threads} threads), "
              f"{store.misses} compiled", file=sys.stderr, flush=True)


class WarmupProgress:
    """A rich progress bar on stderr when rich is installed, else one plain line per bucket.
    Each bucket's compile time is printed once, when it is done."""

    def __init__(self, total: int, label: str = "compiling step buckets", rich: bool = True):
        """rich=False: plain lines only (a live bar would redraw under a serving program's
        own output)."""
        self.total, self.label, self.done = total, label, 0
        self.t0 = time.perf_counter()
        self.bar = self.task = None
        if not rich:
            return
        try:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, \
                TimeElapsedColumn
            self.bar = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=Console(stderr=True))
        except ImportError:
            pass

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
            self.task = self.bar.add_task(self.label, total=self.total)
        return self

    def update(self, T: int, F: int, seconds: float) -> None:
        self.done += 1
        line = f"[{self.done}/{self.total}] step bucket T={T} F={F}: {seconds:.2f} s"
        if self.bar is not None:
            self.bar.console.print(line)
            self.bar.update(self.task, advance=1)
        else:
            print(f"{self.label} {line}", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
        print(f"warm-up: {self.done} step buckets in {time.perf_counter() - self.t0:.1f} s",
              file=sys.stderr, flush=True)
        return False
