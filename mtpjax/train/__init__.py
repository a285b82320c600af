"""Training target + MTP models as a library (docs/training.md).

    LossConfig, joint_loss            target CE + weighted per-depth MTP losses (data labels or
                                      self-distillation to the target), regimes multi_layer /
                                      chain / both
    multi_layer_depths, chain_depths  teacher-forced depth logits of the two drafting regimes
    Trainer, TrainState, adamw        jitted, donated train step; trainable "all" or "mtp"
    fit, evaluate_windows, lr_at      the loop (schedule, progress bar, log, checkpoints)
    save_train_state, restore_train_state   Orbax training checkpoints
    finetune_mtp, reinit_mtp          MTP-head fine-tuning on a frozen target

CLIs: `python -m mtpjax.train.tiny` (the shipped tiny models) and `python -m
mtpjax.train.finetune` (heads of a model folder, acceptance before / after).
"""

from mtpjax.train.checkpointing import restore_train_state, save_train_state
from mtpjax.train.depths import REGIMES, chain_depths, depth_logits, multi_layer_depths
from mtpjax.train.loop import FitResult, evaluate_windows, fit, lr_at
from mtpjax.train.loss import LABELS, LossConfig, joint_loss
from mtpjax.train.step import TrainState, Trainer, adamw, merge_params, split_params

__all__ = ["LABELS", "REGIMES", "FitResult", "LossConfig", "TrainState", "Trainer", "adamw",
           "chain_depths", "depth_logits", "evaluate_windows", "fit",
           "joint_loss", "lr_at", "merge_params", "multi_layer_depths",
           "restore_train_state", "save_train_state", "split_params"]


def __getattr__(name):
    # finetune is also a script (`python -m mtpjax.train.finetune`): loaded on first use, as
    # runpy warns about a script already in sys.modules when it runs it as __main__
    if name in ("finetune_mtp", "reinit_mtp"):
        from mtpjax.train import finetune
        return getattr(finetune, name)
    raise AttributeError(f"module 'mtpjax.train' has no attribute {name!r}")
