"""The acceptance-rule registry: a rule name -> the object that owns everything about the rule.

`SpecConfig(acceptance=NAME)` names a rule; config validation, the `mtpjax generate` /
`mtpjax serve` option choices, the device step (`accept.apply_acceptance`), the draft loop and
the host code that carries a rule's per-slot flag (engine runner, `generate`) all ask the entry,
never the name. Each built-in rule is one module of this package; adding a rule is one class
(subclass `AcceptanceRule`) and one `register_acceptance_rule` line, from any module
(`tests/speculative/test_acceptance_rules.py` adds one from the test file alone).
"""

import importlib
from typing import Any, Callable, NamedTuple, Sequence


class AcceptInputs(NamedTuple):
    """What every rule's `accept` receives (traced arrays, one row per request of the batch)."""

    logits: Any          # f32[B, K+1, V] target logits, processed as plain decoding's are
    drafts: Any          # int32[B, K]
    draft_probs: Any     # f32[B, K, V] the distributions the drafts were drawn from
    num_drafts: Any      # int32[B] drafts each row verifies (0: a final prefill chunk)
    flag: Any            # bool[B] the rule's per-slot flag before this step (False if it has none)
    sampling: Any        # SamplingArrays of the rows (mode: static)
    key_positions: Any   # int32[B] position of the first token this step commits
    keys: Any            # uint32[B, 2] this step's acceptance keys (stream 1 at key_positions)
    own_drafts: bool     # static: the drafts were drawn from draft_probs in this same step


class AcceptanceRule:
    """Base of a rule entry; a rule overrides `name`, `accept` and what else it needs.

    name                      the `SpecConfig.acceptance` value
    summary                   one line for docs and help
    offered_by_server         `mtpjax serve --acceptance` lists it (rules whose tokens a client
                              can rely on: lossless, or exact-match greedy)
    drafts_share_target_keys  the drafter draws position p with the key the target samples p
                              with (coupled acceptance), instead of a stream of its own
    params                    the SpecConfig fields the rule reads (docs)
    slot_flag                 None, or `f(tokens, spec) -> bool`: the rule's per-slot flag after
                              a token prefix (host side; e.g. relaxed: inside the thinking
                              phase). The device carries it per slot (`SlotState.in_thinking`)
                              and `accept` returns it after the committed tokens.
    """

    name: str = ""
    summary: str = ""
    offered_by_server: bool = False
    drafts_share_target_keys: bool = False
    params: tuple[str, ...] = ()
    slot_flag: Callable[[Sequence[int], Any], bool] | None = None

    def check_params(self, spec) -> None:
        """Raises ValueError naming a bad value of the rule's parameters. Runs for every
        registered rule on every SpecConfig (it carries all rules' parameters)."""

    def check_selected(self, spec) -> None:
        """Raises ValueError when `spec` selects this rule without what it needs."""

    def accept(self, spec, x: AcceptInputs):
        """-> (accepted_tokens int32[B, K+1], num_accepted int32[B] in 1..num_drafts+1,
        flag bool[B] after the committed tokens; a rule without a slot flag returns x.flag)."""
        raise NotImplementedError


ACCEPTANCE_RULES: dict[str, AcceptanceRule] = {}
_builtin_loaded = False


def register_acceptance_rule(rule: AcceptanceRule) -> AcceptanceRule:
    """Adds `rule` under `rule.name`; a different rule of the same name is an error."""
    _load_builtin()
    if not isinstance(rule.name, str) or not rule.name:
        raise ValueError(f"an acceptance rule needs a non-empty string name, got {rule.name!r}")
    old = ACCEPTANCE_RULES.get(rule.name)
    if old is not None and old is not rule:
        raise ValueError(f"acceptance rule {rule.name!r} is already registered ({old!r})")
    ACCEPTANCE_RULES[rule.name] = rule
    return rule


def unregister_acceptance_rule(name: str) -> None:
    """Removes a rule added with `register_acceptance_rule` (built-in rules stay)."""
    _load_builtin()
    if name in BUILTIN_RULES:
        raise ValueError(f"acceptance rule {name!r} is built in and cannot be unregistered")
    if name not in ACCEPTANCE_RULES:
        raise ValueError(f"acceptance rule {name!r} is not registered; registered: "
                         f"{acceptance_rule_names()}")
    del ACCEPTANCE_RULES[name]


def acceptance_rule(name: str) -> AcceptanceRule:
    """The entry of `name`; an unknown name is a ValueError naming the registered rules."""
    _load_builtin()
    rule = ACCEPTANCE_RULES.get(name) if isinstance(name, str) else None
    if rule is None:
        raise ValueError(f"acceptance {name!r} is not a registered acceptance rule; registered: "
                         f"{acceptance_rule_names()}")
    return rule


def acceptance_rule_names() -> tuple[str, ...]:
    """Registered rule names: the built-in rules in their fixed order, then the others in
    registration order."""
    _load_builtin()
    return (tuple(n for n in BUILTIN_RULES if n in ACCEPTANCE_RULES)
            + tuple(n for n in ACCEPTANCE_RULES if n not in BUILTIN_RULES))


BUILTIN_RULES = ("rejection", "coupled", "greedy", "relaxed", "synthetic")


def _load_builtin() -> None:
    # the built-in rules register themselves on import (lazily: they import the acceptance
    # functions, whose modules import the config, which asks this registry)
    global _builtin_loaded
    if _builtin_loaded:
        return
    _builtin_loaded = True          # before the imports: each module registers its rule
    try:
        for name in BUILTIN_RULES:      # in this order: the order of CLI choices and docs
            importlib.import_module(f"mtpjax.speculative.rules.{name}")
    except BaseException:
        _builtin_loaded = False
        raise
