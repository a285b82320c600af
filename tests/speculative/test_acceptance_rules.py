"""Acceptance rules are registered units: a toy rule is added from this file alone (its class
below and one `register_acceptance_rule` line) and SpecConfig, the CLI, `generate` and the
engine run it, carrying its per-slot flag. Also the registry's errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtpjax
from mtpjax import cli
from mtpjax.speculative.rules import (AcceptanceRule, acceptance_rule, acceptance_rule_names,
                                      register_acceptance_rule, unregister_acceptance_rule)
from tests.conftest import tiny_config

TOY = "toy_gated"
K = 2


class GatedAcceptAll(AcceptanceRule):
    """A toy (lossy) rule with a per-slot flag: a request whose prompt has odd length keeps
    every draft (then the target's argmax as the bonus token); any other request keeps none
    (it commits the target's argmax, i.e. plain greedy decoding). The flag is set on the host
    from the prompt and carried unchanged from step to step by the device state."""

    name = TOY
    summary = "toy: odd-length prompts keep every draft, others none"
    slot_flag = staticmethod(lambda tokens, spec: len(tokens) % 2 == 1)

    def accept(self, spec, x):
        target = jnp.argmax(x.logits, axis=-1).astype(jnp.int32)               # [B, K+1]
        k = x.drafts.shape[1]
        n = jnp.where(x.flag, jnp.clip(x.num_drafts, 0, k), 0)                  # drafts kept
        bonus = jnp.take_along_axis(target, n[:, None], axis=1)
        padded = jnp.concatenate([x.drafts, bonus], axis=1)
        tokens = jnp.where(jnp.arange(k + 1)[None, :] < n[:, None], padded, bonus)
        return tokens.astype(jnp.int32), (n + 1).astype(jnp.int32), x.flag


@pytest.fixture(scope="module", autouse=True)
def toy_rule():
    rule = register_acceptance_rule(GatedAcceptAll())
    yield rule
    unregister_acceptance_rule(TOY)
    assert TOY not in acceptance_rule_names()


def _model(seed):
    cfg = tiny_config(vocab_size=64)
    return cfg, mtpjax.init_params(cfg, jax.random.PRNGKey(seed), std=0.3)


def _argmax_after(params, cfg, prompt, out):
    """The target's greedy token after prompt + out[:j], for every j (one causal forward,
    right-padded to 32 tokens: one compile for every call, and causal, so the padding is inert)."""
    seq = list(prompt) + list(out)
    padded = jnp.zeros((1, 32), jnp.int32).at[0, :len(seq)].set(jnp.asarray(seq))
    logits = mtpjax.forward(params, cfg, padded)[0, :len(seq)]
    return np.asarray(jnp.argmax(logits[len(prompt) - 1:], axis=-1)).tolist()


def test_registry_lists_the_toy_rule_and_config_accepts_it():
    assert acceptance_rule_names()[:5] == ("rejection", "coupled", "greedy", "relaxed",
                                           "synthetic")
    assert acceptance_rule_names()[-1] == TOY
    spec = mtpjax.SpecConfig(num_speculative_tokens=K, acceptance=TOY)
    assert acceptance_rule(spec.acceptance).name == TOY
    # another rule's parameters are still checked whichever rule is selected
    with pytest.raises(ValueError, match=r"relaxed_delta must be in \[0, 1\], got 2"):
        mtpjax.SpecConfig(acceptance=TOY, relaxed_delta=2.0)


def test_unknown_rule_names_the_registered_rules():
    with pytest.raises(ValueError, match=r"acceptance 'nope' is not a registered acceptance "
                                         r"rule; registered: .*'rejection'.*'toy_gated'"):
        mtpjax.SpecConfig(acceptance="nope")
    with pytest.raises(ValueError, match=r"already registered"):
        register_acceptance_rule(GatedAcceptAll())          # a second object of the same name
    with pytest.raises(ValueError, match=r"'greedy' is built in"):
        unregister_acceptance_rule("greedy")


def test_cli_lists_the_toy_rule(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--help"])
    assert e.value.code == 0
    assert TOY in capsys.readouterr().out
    from mtpjax.serve.server import build_parser      # the server offers only its own rules
    choices = next(a.choices for a in build_parser()._actions if a.dest == "acceptance")
    assert "rejection" in choices and TOY not in choices and "synthetic" not in choices


@pytest.mark.parametrize("seed", [0, 1])
def test_generate_runs_the_toy_rule_and_carries_its_flag(seed):
    cfg, params = _model(seed)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 64, size=n).tolist() for n in (5, 4, 3)]   # flags: on, off, on
    n_new = 10
    plain = mtpjax.generate(params, cfg, prompts, max_new_tokens=n_new, page_size=4).tokens
    forced = rng.integers(0, 64, size=(3, 5 + n_new + 2 * K + 2)).astype(np.int32)
    out = mtpjax.generate(params, cfg, prompts, max_new_tokens=n_new, page_size=4,
                          spec=mtpjax.SpecConfig(num_speculative_tokens=K, acceptance=TOY),
                          draft_source="forced", forced_drafts=forced)
    # flag off: nothing accepted, so exactly plain greedy decoding
    assert out.tokens[1] == plain[1]
    for b in (0, 2):
        toks, P = out.tokens[b], len(prompts[b])
        assert len(toks) == n_new and toks != plain[b]
        greedy = _argmax_after(params, cfg, prompts[b], toks)
        for j, t in enumerate(toks):
            # token j sits at position P + j; each verify step keeps its K forced drafts, then
            # the target's argmax (the first token is the prefill's)
            assert t == (greedy[j] if j % (K + 1) == 0 else forced[b, P + j]), (b, j)
    s = out.stats
    assert 0 < s["accepted_draft_tokens"] < s["proposed_draft_tokens"]


def test_engine_runs_the_toy_rule():
    cfg, params = _model(3)
    prompts = [[7, 8, 9], [10, 11, 12, 13]]                      # flags: on, off
    n_new = 1 + 3 * (K + 1)                                      # whole verify steps
    plain = mtpjax.generate(params, cfg, prompts, max_new_tokens=n_new, page_size=4).tokens
    llm = mtpjax.LLM(params, cfg, mtpjax.SpecConfig(num_speculative_tokens=K, acceptance=TOY),
                     num_pages=32, page_size=4, max_num_seqs=2, max_num_batched_tokens=32)
    on, off = llm.generate(prompts, mtpjax.SamplingParams(max_tokens=n_new))
    assert off.token_ids == plain[1]
    assert off.num_draft_tokens > 0 and off.num_accepted_draft_tokens == 0
    assert on.num_accepted_draft_tokens == on.num_draft_tokens == K * 3
    greedy = _argmax_after(params, cfg, prompts[0], on.token_ids)
    assert [on.token_ids[j] for j in range(0, n_new, K + 1)] == greedy[0:n_new:K + 1]
