"""Acceptance rules as registered units: `registry.py` (the entry type and the registry) and
one module per built-in rule (rejection, coupled, greedy, relaxed, synthetic). The batched
device functions they call live in `mtpjax.speculative.accept`."""

from mtpjax.speculative.rules.registry import (ACCEPTANCE_RULES, AcceptanceRule, AcceptInputs,
                                               acceptance_rule, acceptance_rule_names,
                                               register_acceptance_rule,
                                               unregister_acceptance_rule)

__all__ = ["ACCEPTANCE_RULES", "AcceptanceRule", "AcceptInputs", "acceptance_rule",
           "acceptance_rule_names", "register_acceptance_rule", "unregister_acceptance_rule"]
