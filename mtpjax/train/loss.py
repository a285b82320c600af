"""The joint loss: target cross-entropy plus weighted per-depth MTP losses.

For windows x int32[B, T + S + 1] (S = `depths`), roots i = 0..T-1, target logits z_p (the
target's prediction for position p+1, run over x_0..x_{T+S-1}) and depth-s logits l^s_i
(predicting x_{i+s+2}; `mtpjax.train.depths`):

    L = target_weight * mean_i CE(z_i, x_{i+1})
        + sum_s w_s * mean_regimes mean_i loss_s(l^s_i),        w_s = mtp_weight * depth_decay^s

    loss_s  labels "data":          CE(l^s_i, x_{i+s+2})                  (joint pre-training)
            labels "target_kl":     KL(softmax(z_{i+s+1}) || softmax(l^s_i))   (self-distillation)
            labels "target_greedy": CE(l^s_i, argmax z_{i+s+1})               (self-distillation)

z_{i+s+1} is the target's next-token distribution at exactly the position depth s drafts, so
the distillation labels are what acceptance is measured against. Teacher logits are under
`stop_gradient`. Regime "both" averages the multi_layer and chain losses of each depth (depth 0
is the same in both).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mtpjax.config import ModelConfig
from mtpjax.model.transformer import forward
from mtpjax.train.depths import REGIMES, chain_depths, multi_layer_depths

LABELS = ("data", "target_kl", "target_greedy")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """What the loss trains (hashable: a static argument of the jitted step)."""

    depths: int = 1                 # MTP depths trained (S); depth s uses module s % D
    regime: str = "multi_layer"     # "multi_layer" | "chain" | "both"
    mtp_weight: float = 0.5
    depth_decay: float = 0.5
    target_weight: float = 1.0      # 0 when the target is frozen (its CE is still reported)
    labels: str = "data"            # "data" | "target_kl" | "target_greedy"

    def __post_init__(self):
        if isinstance(self.depths, bool) or not isinstance(self.depths, int) or self.depths < 1:
            raise ValueError(f"depths must be an int >= 1, got {self.depths!r}")
        if self.regime not in REGIMES + ("both",):
            raise ValueError(f"regime {self.regime!r} is not one of {REGIMES + ('both',)}")
        if self.labels not in LABELS:
            raise ValueError(f"labels {self.labels!r} is not one of {LABELS}")
        for name in ("mtp_weight", "depth_decay", "target_weight"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")

    @property
    def regimes(self) -> tuple[str, ...]:
        return REGIMES if self.regime == "both" else (self.regime,)

    @property
    def weights(self) -> tuple[float, ...]:
        return tuple(self.mtp_weight * self.depth_decay ** s for s in range(self.depths))

    def window_length(self, context: int) -> int:
        """Tokens per training window for `context` roots: context + depths + 1."""
        return context + self.depths + 1


def _log_softmax(logits):
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def _nll(logp, labels):
    return -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]


def depth_loss(logits, data_labels, teacher_logits, labels: str):
    """Per-position loss f32[B, T] of one depth: logits [B, T, V]; data_labels int32[B, T];
    teacher_logits [B, T, V] (the target at the same future position)."""
    logq = _log_softmax(logits)
    if labels == "data":
        return _nll(logq, data_labels)
    if labels == "target_greedy":
        return _nll(logq, jnp.argmax(teacher_logits, axis=-1))
    logp = _log_softmax(teacher_logits)
    return jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)


def check_model(cfg: ModelConfig, loss_cfg: LossConfig) -> None:
    if cfg.num_mtp_layers < 1:
        raise ValueError("training MTP depths needs a model with num_mtp_layers >= 1, got 0")


def joint_loss(params, cfg: ModelConfig, windows: jax.Array, loss_cfg: LossConfig):
    """windows int32[B, T + depths + 1] -> (loss f32[], metrics).

    metrics (all means over roots and batch): target_loss f32[], target_acc f32[] (top-1 vs
    data), mtp_loss f32[R, S] (the trained per-depth loss, R = regimes), mtp_acc f32[R, S] (top-1
    vs data), agree f32[R, S] (argmax == the target's argmax at the drafted position: greedy
    acceptance of depth s when the earlier drafts were accepted).
    """
    S = loss_cfg.depths
    T = windows.shape[1] - S - 1
    if windows.ndim != 2 or T < 1:
        raise ValueError(f"windows must be int32[B, T + depths + 1] with T >= 1 (depths={S}), "
                         f"got shape {windows.shape}")
    logits, hidden = forward(params, cfg, windows[:, :T + S], return_hidden=True)
    teacher = jax.lax.stop_gradient(logits)
    target_loss = _nll(_log_softmax(logits[:, :T]), windows[:, 1:T + 1]).mean()
    target_acc = (jnp.argmax(logits[:, :T], -1) == windows[:, 1:T + 1]).mean()
    h0 = hidden[:, :T]

    per_regime = {}
    if "multi_layer" in loss_cfg.regimes:
        per_regime["multi_layer"] = multi_layer_depths(params, cfg, h0, windows, S)
    if "chain" in loss_cfg.regimes:
        per_regime["chain"] = chain_depths(params, cfg, h0, windows, S)
    losses, accs, agrees = [], [], []
    for regime in loss_cfg.regimes:
        row_l, row_a, row_g = [], [], []
        for s, lg in enumerate(per_regime[regime]):
            data = windows[:, s + 2:s + 2 + T]
            t_lg = teacher[:, s + 1:s + 1 + T]
            row_l.append(depth_loss(lg, data, t_lg, loss_cfg.labels).mean())
            pred = jnp.argmax(lg, -1)
            row_a.append((pred == data).mean())
            row_g.append((pred == jnp.argmax(t_lg, -1)).mean())
        losses.append(jnp.stack(row_l))
        accs.append(jnp.stack(row_a))
        agrees.append(jnp.stack(row_g))
    mtp_loss = jnp.stack(losses)                                   # [R, S]
    total = loss_cfg.target_weight * target_loss + jnp.sum(
        jnp.asarray(loss_cfg.weights, jnp.float32) * mtp_loss.mean(axis=0))
    return total, {"target_loss": target_loss, "target_acc": target_acc, "mtp_loss": mtp_loss,
                   "mtp_acc": jnp.stack(accs), "agree": jnp.stack(agrees)}
