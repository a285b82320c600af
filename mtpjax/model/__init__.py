"""Model: parameter tree, layers, attention dispatch, target forward, MTP modules."""

from mtpjax.model.backend import AttentionBackend, resolve_backend
from mtpjax.model.params import abstract_params, init_params, logical_axes, param_specs
from mtpjax.model.transformer import forward, forward_cached, logits_from_hidden
from mtpjax.model.mtp import mtp_forward, mtp_forward_cached

__all__ = ["AttentionBackend", "resolve_backend", "abstract_params", "init_params", "logical_axes", "param_specs", "forward",
           "forward_cached", "logits_from_hidden", "mtp_forward", "mtp_forward_cached"]
