"""Saving and resuming a training run with Orbax.

    DIR/state/       the TrainState pytree (orbax StandardCheckpointer): step, trainable params,
                     optimizer state, each restored into the sharding of the template's leaves
    DIR/loop.json    {"step": int, "rng": numpy bit-generator state} - the data order resumes
                     exactly where it stopped

The finished model goes out as a Hugging Face folder (`mtpjax.checkpoint.export_hf`) or an
mtpjax Orbax model folder (`mtpjax.checkpoint.save`), both loadable by `LLM.from_pretrained`.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from mtpjax.checkpoint.atomic import atomic_dir
from mtpjax.train.step import TrainState

STATE_DIR = "state"
LOOP_FILE = "loop.json"


def save_train_state(path: str, state: TrainState, rng: np.random.Generator | None = None) -> None:
    """Writes DIR (all or nothing; an existing DIR is an error)."""
    import orbax.checkpoint as ocp
    with atomic_dir(path) as tmp:
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(os.path.join(tmp, STATE_DIR), state)
        with open(os.path.join(tmp, LOOP_FILE), "w") as f:
            json.dump({"step": int(state.step),
                       "rng": None if rng is None else rng.bit_generator.state}, f)


def restore_train_state(path: str, like: TrainState) -> tuple[TrainState, np.random.Generator | None]:
    """(state, data rng or None) from DIR; `like` (e.g. a fresh `Trainer.init` state) gives the
    tree structure, dtypes and shardings."""
    import orbax.checkpoint as ocp
    if not os.path.isfile(os.path.join(path, LOOP_FILE)):
        raise ValueError(f"{path} is not a training checkpoint (no {LOOP_FILE}); expected a "
                         "folder written by mtpjax.train.save_train_state")
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                            like)
    with ocp.StandardCheckpointer() as ckptr:
        state = ckptr.restore(os.path.abspath(os.path.join(path, STATE_DIR)), abstract)
    with open(os.path.join(path, LOOP_FILE)) as f:
        loop = json.load(f)
    rng = None
    if loop.get("rng") is not None:
        rng = np.random.default_rng()
        rng.bit_generator.state = loop["rng"]
    return state, rng
