"""Train state, optimizer and the jitted train step (one device or a ("data", "model") mesh).

Two ways to train (`trainable`):
    "all"  joint training: every param gets gradients (target CE + MTP losses).
    "mtp"  MTP-head fine-tuning on a frozen target: only `params["mtp"]` gets gradients; the
           target's params (embedding and lm_head included, which the modules share) are a
           separate, never-updated argument, so they stay bit-identical.

The step is `step(state, frozen, windows, lr) -> (state, metrics)`, jitted with the state
donated. It has no data-dependent branch (static Python choices only). Under a mesh the params
and optimizer state keep the sharding table's shardings (`mtpjax.parallel`) and windows are
split over "data" when the batch divides.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P

from mtpjax.config import ModelConfig
from mtpjax.parallel import check_mesh, shard_params
from mtpjax.train.loss import LossConfig, check_model, joint_loss

TRAINABLE = ("all", "mtp")


@struct.dataclass
class TrainState:
    """What the optimizer updates. Leaves of `params` keep the shapes of `param_specs(cfg)`."""

    step: jax.Array      # int32[]   optimizer steps taken
    params: Any          # trainable params: the whole tree ("all") or {"mtp": D x module} ("mtp")
    opt_state: Any       # optax state of `params` (AdamW: mu and nu shaped like params, count int32[])


def split_params(params, trainable: str):
    """params -> (trainable tree, frozen tree); `merge_params` inverts it."""
    if trainable == "all":
        return params, {}
    if trainable == "mtp":
        if "mtp" not in params:
            raise ValueError("trainable='mtp' needs params with MTP modules (params['mtp'])")
        return {"mtp": params["mtp"]}, {k: v for k, v in params.items() if k != "mtp"}
    raise ValueError(f"trainable {trainable!r} is not one of {TRAINABLE}")


def merge_params(trainable, frozen):
    return {**frozen, **trainable}


def adamw(learning_rate: float = 3e-3, *, b1: float = 0.9, b2: float = 0.95,
          weight_decay: float = 0.1, clip: float = 1.0) -> optax.GradientTransformation:
    """Global-norm clipping + AdamW, with the learning rate injectable per step (the `lr`
    argument of the train step sets it, so a host-side schedule - e.g. one that follows wall
    time - needs no recompile)."""
    def make(learning_rate):
        return optax.chain(optax.clip_by_global_norm(clip),
                           optax.adamw(learning_rate, b1=b1, b2=b2, weight_decay=weight_decay))
    return optax.inject_hyperparams(make)(learning_rate=learning_rate)


def _set_lr(opt_state, lr):
    if lr is None:
        return opt_state
    hp = getattr(opt_state, "hyperparams", None)
    if hp is None or "learning_rate" not in hp:
        raise ValueError("lr= needs an optimizer built with optax.inject_hyperparams and a "
                         "learning_rate hyperparameter (e.g. mtpjax.train.adamw); pass lr=None "
                         "to use the optimizer's own schedule")
    return opt_state._replace(hyperparams={**hp, "learning_rate": jnp.asarray(lr, jnp.float32)})


@dataclasses.dataclass(frozen=True)
class Trainer:
    """cfg + loss + optimizer + what is trainable; `init` and `step` do the work.

    trainer = Trainer(cfg, LossConfig(depths=2), adamw(3e-3), trainable="all", mesh=None)
    state, frozen = trainer.init(params)
    state, metrics = trainer.step(state, frozen, windows, lr)      # windows int32[B, T+S+1]
    params = trainer.params(state, frozen)
    """

    cfg: ModelConfig
    loss: LossConfig
    optimizer: optax.GradientTransformation
    trainable: str = "all"
    mesh: Any = None

    def __post_init__(self):
        if self.trainable not in TRAINABLE:
            raise ValueError(f"trainable {self.trainable!r} is not one of {TRAINABLE}")
        check_model(self.cfg, self.loss)
        object.__setattr__(self, "mesh", check_mesh(self.mesh))
        object.__setattr__(self, "_jitted", {})

    def init(self, params) -> tuple[TrainState, Any]:
        """(TrainState at step 0, frozen params). The state holds a copy of the trainable
        params (the step donates its state, and the caller's arrays stay valid). Under a mesh,
        params are placed by the sharding table first and the optimizer state follows them."""
        if self.mesh is not None:
            params = shard_params(params, self.cfg, self.mesh)
        trainable, frozen = split_params(params, self.trainable)
        trainable = jax.tree.map(jnp.copy, trainable)
        state = TrainState(step=jnp.zeros((), jnp.int32), params=trainable,
                           opt_state=jax.jit(self.optimizer.init)(trainable))
        if self.mesh is not None:       # counters and scalars: replicated over the mesh
            replicated = NamedSharding(self.mesh, P())
            state = jax.tree.map(lambda a: a if isinstance(a.sharding, NamedSharding)
                                 and a.sharding.mesh == self.mesh
                                 else jax.device_put(a, replicated), state)
        return state, frozen

    def params(self, state: TrainState, frozen):
        """The whole param tree (trained leaves merged back with the frozen ones)."""
        return merge_params(state.params, frozen)

    def place_windows(self, windows) -> jax.Array:
        """Host windows -> device, split over the mesh's "data" axis when the batch divides."""
        windows = np.asarray(windows, np.int32)
        if self.mesh is None:
            return jnp.asarray(windows)
        n = int(self.mesh.shape["data"])
        spec = P("data") if windows.shape[0] % n == 0 else P()
        return jax.device_put(windows, NamedSharding(self.mesh, spec))

    def loss_fn(self, trainable, frozen, windows):
        return joint_loss(merge_params(trainable, frozen), self.cfg, windows, self.loss)

    def _compiled(self, state: TrainState):
        key = jax.tree.structure(state)
        fn = self._jitted.get(key)
        if fn is None:
            def step(state, frozen, windows, lr):
                (total, metrics), grads = jax.value_and_grad(self.loss_fn, has_aux=True)(
                    state.params, frozen, windows)
                opt_state = _set_lr(state.opt_state, lr)
                updates, opt_state = self.optimizer.update(grads, opt_state, state.params)
                new = TrainState(step=state.step + 1,
                                 params=optax.apply_updates(state.params, updates),
                                 opt_state=opt_state)
                return new, {"loss": total, **metrics}

            kw = {}
            if self.mesh is not None:       # the new state keeps the shardings it came in with
                shardings = jax.tree.map(lambda a: a.sharding, state)
                kw["out_shardings"] = (shardings, NamedSharding(self.mesh, P()))
            fn = self._jitted[key] = jax.jit(step, donate_argnums=(0,), **kw)
        return fn

    def step(self, state: TrainState, frozen, windows, lr=None):
        """One optimizer step on windows int32[B, T + depths + 1]; lr: the learning rate of
        this step (optimizers from `adamw`), or None to keep the optimizer's own."""
        if not isinstance(windows, jax.Array):
            windows = self.place_windows(windows)
        return self._compiled(state)(state, frozen, windows,
                                     None if lr is None else jnp.float32(lr))

    def evaluate(self, params, windows) -> dict:
        """The loss metrics of `joint_loss` (host floats / lists) over windows int32[B, T+S+1]."""
        fn = self._jitted.get("eval")
        if fn is None:
            fn = self._jitted["eval"] = jax.jit(
                lambda p, w: joint_loss(p, self.cfg, w, self.loss))
        total, metrics = fn(params, windows if isinstance(windows, jax.Array)
                            else self.place_windows(windows))
        return {"loss": float(total), **{k: np.asarray(v).tolist() for k, v in metrics.items()}}
