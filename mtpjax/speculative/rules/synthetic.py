"""Acceptance rule "synthetic" (BENCHMARK-ONLY): draft i is accepted with probability
`synthetic_accept_rate` (or its i-th entry) given that drafts 1..i-1 were, whatever the models
say; the correction / bonus token is the target's argmax (docs/spec_decoding.md)."""

from __future__ import annotations

import jax.numpy as jnp

from mtpjax.speculative.accept import accept_synthetic
from mtpjax.speculative.rules.registry import AcceptanceRule, register_acceptance_rule


class Synthetic(AcceptanceRule):
    name = "synthetic"
    summary = "BENCHMARK-ONLY: each draft accepted with a fixed probability"
    params = ("synthetic_accept_rate",)

    def check_params(self, spec):
        rates = spec.synthetic_accept_rate
        rates = tuple(rates) if isinstance(rates, (tuple, list)) else (rates,)
        for r in rates:
            if not 0.0 <= r <= 1.0:
                raise ValueError(f"synthetic_accept_rate entries must be in [0, 1], got {r!r}")
        if len(rates) not in (1, spec.num_speculative_tokens):
            raise ValueError(
                f"synthetic_accept_rate has {len(rates)} entries; expected 1 or K="
                f"{spec.num_speculative_tokens}")

    def accept(self, spec, x):
        rates = jnp.asarray(spec.synthetic_rates(), jnp.float32)
        return (*accept_synthetic(x.logits, x.drafts, x.num_drafts, rates, x.keys), x.flag)


register_acceptance_rule(Synthetic())
