"""The training loop: schedule, progress bar, loss / acceptance log, periodic checkpoints.

`fit` drives `Trainer.step` with windows from a host sampler. The run length is `steps`
(exact, reproducible) and/or `seconds` of wall time after the first (compiling) step; the
learning rate follows the run's progress (linear warmup, cosine decay), computed on the host and
passed to the step as an array, so it never recompiles.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from typing import Callable

import jax
import numpy as np

from mtpjax.train.checkpointing import save_train_state
from mtpjax.train.step import Trainer, TrainState


def lr_at(progress: float, lr: float, warmup: float, min_lr_ratio: float) -> float:
    """Linear warmup over the first `warmup` fraction of the run, then cosine to min_lr_ratio*lr."""
    p = min(max(progress, 0.0), 1.0)
    if p < warmup:
        return lr * p / warmup
    c = 0.5 * (1 + math.cos(math.pi * (p - warmup) / (1 - warmup)))
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * c)


@dataclasses.dataclass
class FitResult:
    steps: int
    seconds: float                   # training loop wall time after the compiling step
    log: list[dict]                  # one record per log line: step, seconds, lr, losses, eval


class _Progress:
    """A rich progress bar on stderr when rich is installed, `enabled` and stderr is a terminal;
    log lines either way."""

    def __init__(self, enabled: bool):
        self.bar = None
        if enabled:
            try:
                from rich.console import Console
                from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
                console = Console(stderr=True)
                if not console.is_terminal:       # logs and CI: plain lines only
                    return
                self.bar = Progress(TextColumn("training"), BarColumn(),
                                    TextColumn("{task.percentage:>3.0f}%"), TimeElapsedColumn(),
                                    TextColumn("{task.fields[status]}"), console=console)
                self.bar.start()
                self.task = self.bar.add_task("training", total=1.0, status="")
            except ImportError:
                self.bar = None

    def update(self, progress: float, status: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=min(progress, 1.0), status=status)

    def line(self, text: str) -> None:
        if self.bar is not None:
            self.bar.console.print(text, markup=False, highlight=False, soft_wrap=True)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _fmt(xs) -> str:
    return " ".join(f"{x:.3f}" for x in np.ravel(xs))


def fit(trainer: Trainer, state: TrainState, frozen, sample: Callable[[np.random.Generator], np.ndarray],
        *, rng: np.random.Generator, steps: int | None = None, seconds: float | None = None,
        lr: float = 3e-3, warmup: float = 0.05, min_lr_ratio: float = 0.05,
        log_every: float = 10.0, evaluate: Callable[[dict], dict] | None = None,
        eval_every: float | None = None, checkpoint_dir: str | None = None,
        checkpoint_every: int | None = None, progress: bool = True) -> tuple[TrainState, FitResult]:
    """Trains until `steps` and/or `seconds` are used up; returns (state, FitResult).

    sample(rng) -> int32[B, T + depths + 1] host windows (one call per step, in order, so a
    seed fixes the data). log_every: seconds between log lines (0: every step). evaluate(params)
    -> dict of host values, run every `eval_every` seconds (and at the end) and logged (e.g. the
    teacher-forced agreement with the target on held-out windows: an acceptance estimate).
    checkpoint_dir / checkpoint_every: `save_train_state` into checkpoint_dir/step_{N}.
    """
    if steps is None and seconds is None:
        raise ValueError("fit needs steps= and/or seconds=")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if seconds is not None and not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds!r}")
    if not 0 <= warmup < 1:
        raise ValueError(f"warmup is a fraction of the run in [0, 1), got {warmup!r}")
    bar = _Progress(progress)
    log: list[dict] = []
    step, t_train, last_log, last_eval = 0, None, -math.inf, 0.0
    start_step = int(state.step)
    try:
        while True:
            elapsed = 0.0 if t_train is None else time.perf_counter() - t_train
            frac = max(step / steps if steps else 0.0, elapsed / seconds if seconds else 0.0)
            if frac >= 1.0:
                break
            lr_now = lr_at(frac, lr, warmup, min_lr_ratio)
            state, metrics = trainer.step(state, frozen, sample(rng), lr_now)
            step += 1
            if t_train is None:           # the first step compiles: the clock starts after it
                jax.block_until_ready(metrics["loss"])
                t_train = time.perf_counter()
                elapsed = 0.0
            if checkpoint_dir and checkpoint_every and step % checkpoint_every == 0:
                save_train_state(os.path.join(checkpoint_dir, f"step_{start_step + step}"),
                                 state, rng)
            do_eval = evaluate is not None and eval_every is not None and \
                elapsed - last_eval >= eval_every
            if elapsed - last_log >= log_every or do_eval:
                last_log = elapsed
                m = jax.device_get(metrics)
                rec = {"step": start_step + step, "seconds": round(elapsed, 3), "lr": lr_now,
                       "loss": float(m["loss"]), "target_loss": float(m["target_loss"]),
                       "mtp_loss": np.asarray(m["mtp_loss"]).tolist(),
                       "agree": np.asarray(m["agree"]).tolist()}
                text = (f"step {rec['step']:6d} {elapsed:7.1f}s lr {lr_now:.2e} loss "
                        f"{rec['loss']:.3f} target {rec['target_loss']:.3f} mtp "
                        f"{_fmt(rec['mtp_loss'])} agree {_fmt(rec['agree'])}")
                if do_eval:
                    last_eval = elapsed
                    rec["eval"] = evaluate(trainer.params(state, frozen))
                    text += f" | eval {rec['eval']}"
                log.append(rec)
                bar.line(text)
            bar.update(frac, f"step {start_step + step}")
        jax.block_until_ready(state)
        seconds_used = 0.0 if t_train is None else time.perf_counter() - t_train
        if evaluate is not None:
            log.append({"step": start_step + step, "seconds": round(seconds_used, 3),
                        "eval": evaluate(trainer.params(state, frozen))})
            bar.line(f"step {start_step + step} final eval {log[-1]['eval']}")
    finally:
        bar.close()
    print(f"trained {step} steps in {seconds_used:.1f}s", file=sys.stderr, flush=True)
    return state, FitResult(steps=step, seconds=seconds_used, log=log)


def evaluate_windows(trainer: Trainer, params, windows: np.ndarray, batch_size: int) -> dict:
    """Means of `joint_loss`'s metrics over windows int32[N, T + depths + 1], in batches of
    `batch_size` (the last batch is filled up from the start, so one shape compiles)."""
    acc, n = None, 0
    for i in range(0, len(windows), batch_size):
        b = windows[i:i + batch_size]
        if len(b) < batch_size:
            b = np.concatenate([b, windows[:batch_size - len(b)]])
        m = trainer.evaluate(params, b)
        acc = m if acc is None else {k: np.add(acc[k], m[k]) for k in acc}
        n += 1
    return {k: (float(v) / n if np.ndim(v) == 0 else (np.asarray(v) / n).tolist())
            for k, v in acc.items()}
