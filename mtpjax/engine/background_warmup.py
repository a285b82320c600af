"""Background warm-up: `LLM(..., warmup="background")` serves after compiling one program, and
compiles the other step programs on daemon threads while it serves.

`warm_up_background` (engine/warmup.py) first compiles, on the calling thread and exactly as the
blocking warm-up does (dry run, executable store), the bucket with the most tokens and the
longest first pass, in the "filter" sampling mode at the most draft passes: by
`engine/covering.py` it serves every step, padded up (greedy steps too). Then
`BackgroundWarmup` makes every other bucket's programs, smallest first (the decode buckets a
steady state runs in), and registers each in the runner's `executables` as it is done;
`ModelRunner.dispatch` uses a step's own program as soon as it is there.

Thread safety:
- The threads only look programs up in the executable store and lower + compile. They never
  run one: a dry run needs the device state, which the serving thread owns and donates every
  step. They see the params and the state only as shapes, dtypes and shardings, taken once at
  start (`ModelRunner.background_programs`).
- Registering is one `dict.__setitem__` of a finished executable: under the GIL it is atomic,
  so the serving thread's `executables.get(key)` sees either nothing or the whole program, and
  `covering_program` iterates a `dict.copy()` (one C call, never interleaved with an insert).
- Lowering is serialized among the threads (tracing is Python and holds the GIL); compiles
  and store loads run in parallel (XLA releases the GIL).

The executable store: the threads load programs from it (an entry is only ever saved after it
ran in an earlier process whose key matched) but never save one: saving checks the program's
bytes with a dry run on the state, which only the blocking warm-up can do. Run one
`warmup=True` engine to fill the store; later background starts then load instead of compile.

Lifetime: the threads are daemons (they never keep the process alive) and stop before their
next program when the runner is garbage-collected or `stop()` is called. A program that fails
is reported as a warning (never silently); its bucket is served padded up until the warm-up
is over (`ModelRunner.warming`), then compiles synchronously on first use.
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref

from mtpjax.engine.warmup import WarmupProgress, step_buckets


class BackgroundWarmup:
    """Makes `runner.background_programs(buckets)` on `threads` daemon threads and registers
    them into `runner.executables`; appends (T, F, seconds) to `times` per finished bucket."""

    def __init__(self, runner, buckets: list[tuple[int, int]], times: list, threads: int = 1,
                 progress: bool = True):
        self._executables = runner.executables          # the dict only, never the runner
        self._programs = [p for p in runner.background_programs(buckets)
                          if p[2] not in self._executables]      # not compiled before
        self._times = times
        # buckets the first phase already reported (their other modes / passes come here)
        self._reported = {(T, F) for T, F, *_ in times}
        self._stop = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()                   # the queue position and bookkeeping
        self._lower_lock = threading.Lock()
        self._next = 0
        self._left = {}                                 # (T, F) -> programs still to make
        self._seconds = {}                              # (T, F) -> seconds so far
        self._failed: set = set()
        for T, F, *_ in self._programs:
            self._left[(T, F)] = self._left.get((T, F), 0) + 1
        self.errors: list[str] = []
        weakref.finalize(runner, self._stop.set)        # the LLM is gone: stop
        self._progress = WarmupProgress(len(self._left), "compiling step buckets in the "
                                        "background", rich=False) if progress else None
        self._workers = max(1, min(threads, len(self._programs)))
        self._running = self._workers
        if not self._programs:
            self._done.set()
            return
        if self._progress is not None:
            self._progress.__enter__()
        for i in range(self._workers):
            threading.Thread(target=self._work, name=f"mtpjax-warmup-{i}", daemon=True).start()

    def done(self) -> bool:
        """True once every program is made (or failed, or the warm-up was stopped)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until `done()` or `timeout` seconds; returns `done()`."""
        return self._done.wait(timeout)

    def stop(self) -> None:
        """The threads stop before their next program (one being compiled still finishes)."""
        self._stop.set()

    def _take(self):
        with self._lock:
            if self._stop.is_set() or self._next >= len(self._programs):
                return None
            self._next += 1
            return self._programs[self._next - 1]

    def _work(self) -> None:
        try:
            while (program := self._take()) is not None:
                self._make(*program)
        finally:
            with self._lock:
                self._running -= 1
                last = self._running == 0
            if last:
                if self._progress is not None and not self._stop.is_set():
                    self._progress.__exit__(None, None, None)
                self._done.set()

    def _make(self, T: int, F: int, key: tuple, lookup, lower) -> None:
        t0 = time.perf_counter()
        try:
            found = lookup()
            compiled = found[2] if found is not None else None
            if compiled is None:
                with self._lower_lock:
                    lowered = lower()
                compiled = lowered.compile()
            self._executables[key] = compiled           # atomic: see the module docstring
        except Exception as e:                          # noqa: BLE001 (reported, then serve)
            msg = (f"background warm-up of step bucket T={T} F={F} ({key[2]}) failed: "
                   f"{type(e).__name__}: {str(e)[:300]}; its steps run padded up to a larger "
                   "bucket until the warm-up is over, then compile when first used")
            with self._lock:
                self.errors.append(msg)
                self._failed.add((T, F))
            warnings.warn(msg, RuntimeWarning, stacklevel=1)
        with self._lock:
            self._seconds[(T, F)] = self._seconds.get((T, F), 0.0) + time.perf_counter() - t0
            self._left[(T, F)] -= 1
            finished = self._left[(T, F)] == 0 and (T, F) not in self._failed
            if finished and (T, F) not in self._reported:
                self._times.append((T, F, self._seconds[(T, F)]))
                if self._progress is not None:
                    self._progress.update(T, F, self._seconds[(T, F)])


def covering_bucket(buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """The one (T, F) whose programs serve a step of every bucket in `buckets`, padded up
    (`engine/covering.py`): the most tokens and the longest first pass."""
    return max(T for T, _ in buckets), max(F for _, F in buckets)


def warm_up_background(runner, max_num_batched_tokens: int, max_num_seqs: int,
                       times: list[tuple[int, int, float]],
                       threads: int | None = None) -> BackgroundWarmup:
    """Compiles (or loads) the covering bucket's programs now, as the blocking warm-up does,
    then returns the `BackgroundWarmup` making the rest. threads: default
    `MTPJAX_WARMUP_THREADS`, else min(4, CPUs - 1) (a core stays with the serving thread)."""
    import os
    buckets = step_buckets(max_num_batched_tokens, max_num_seqs, runner.W, runner.min_bucket,
                           runner.decode_tokens)
    if threads is None:
        threads = int(os.environ.get("MTPJAX_WARMUP_THREADS",
                                     max(1, min(4, (os.cpu_count() or 1) - 1))))
    first = covering_bucket(buckets)
    with WarmupProgress(1, "compiling the largest step bucket") as bar:
        def done(T, F, seconds):
            times.append((T, F, seconds))
            bar.update(T, F, seconds)
        # its largest pass count only: a step asking fewer draft passes runs on it meanwhile
        every, runner.warm_passes = runner.warm_passes, runner.warm_passes[-1:]
        # and the "filter" mode only: it serves greedy steps exactly (`covering.serves_mode`),
        # so the first request waits for one compile, not one per mode
        modes, runner.warm_modes = runner.warm_modes, ("filter",)
        try:
            runner.warmup([first], on_compiled=done, threads=threads, load_threads=threads)
        finally:
            runner.warm_passes, runner.warm_modes = every, modes
    warming = BackgroundWarmup(runner, buckets, times, threads)
    runner.warming = warming        # dispatch pads a step up to a compiled bucket meanwhile
    return warming
