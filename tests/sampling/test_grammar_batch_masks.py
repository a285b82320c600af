"""Grammar masks of a step, filled for every grammar row at once (`batch_step_masks`), equal
the one-request-at-a-time masks, drafts refused or not, and leave every matcher where it was."""

import numpy as np
import pytest

from mtpjax import StructuredOutput
from mtpjax.assets import MTP3_MODEL, tiny_model_path
from mtpjax.checkpoint.pretrained import load_pretrained

xgrammar = pytest.importorskip("xgrammar")

from mtpjax.structured.compiler import GrammarCache                       # noqa: E402
from mtpjax.structured.matcher import RequestGrammar, batch_step_masks   # noqa: E402

SPECS = [StructuredOutput(regex=r"(def|for|x)( [a-z]+){1,4}\n"),
         StructuredOutput(json_schema={"type": "object", "properties": {
             "a": {"type": "integer"}, "b": {"type": "boolean"}}, "required": ["a", "b"]}),
         StructuredOutput(json_object=True)]


@pytest.fixture(scope="module")
def grammars():
    ckpt = load_pretrained(tiny_model_path(MTP3_MODEL))
    cfg = ckpt.cfg
    cache = GrammarCache(ckpt.tokenizer, cfg.vocab_size, [ckpt.eos_token_id])
    return cache, cfg.vocab_size


def _reference_masks(g: RequestGrammar, completion, drafts, J):
    """One request's masks with xgrammar's single-matcher calls: fill, accept a draft the mask
    allows, fill again...; stop tokens only where the grammar allows nothing; roll back."""
    g.sync(completion)
    out = np.full((J, g.width), -1, np.int32)

    def fill(j):
        if g.broken_at is None and not g.matcher.is_terminated():
            g.matcher.fill_next_token_bitmask(out, j)
            if out[j].any():
                return
        out[j] = 0
        for t in g.stop_token_ids:
            out[j, t // 32] |= np.int32(1 << (t % 32)) if t % 32 < 31 else np.int32(-2 ** 31)

    fill(0)
    n = 0
    for j, d in enumerate(drafts[:J - 1]):
        if not (out[j, d // 32] >> (d % 32)) & 1 or not g.matcher.accept_token(d):
            break
        n += 1
        fill(j + 1)
    if n:
        g.matcher.rollback(n)
    return out, n


def _walk(g: RequestGrammar, rng, steps: int) -> list[int]:
    """A completion the grammar takes: tokens drawn from its own masks."""
    out = []
    for _ in range(steps):
        mask, _ = g.step_masks(out, [], 1)
        allowed = [t for t in range(g.vocab_size) if (mask[0, t // 32] >> (t % 32)) & 1]
        out.append(int(rng.choice(allowed)))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batch_masks_equal_one_request_at_a_time(grammars, seed):
    cache, V = grammars
    rng = np.random.default_rng(seed)
    J = 4
    items, solo = [], []
    for i in range(6):
        spec = SPECS[i % len(SPECS)]
        a, b = (RequestGrammar(cache.compile(spec), V, cache.stop_token_ids) for _ in range(2))
        completion = _walk(a, rng, int(rng.integers(0, 4)))
        # drafts: a grammar-following run, then (for some) a random token it may refuse
        drafts = _walk_from(cache, spec, V, completion, rng, int(rng.integers(0, J)))
        if rng.random() < 0.5:
            drafts.append(int(rng.integers(0, V)))
        drafts = drafts[:J - 1]
        items.append((a, completion, drafts))
        solo.append(_reference_masks(b, completion, drafts, J))
    masks, n_valid = batch_step_masks(items, J)
    for i, (m, n) in enumerate(solo):
        np.testing.assert_array_equal(masks[i], m)
        assert n_valid[i] == n
    # every matcher rolled back to its committed tokens: the next step's masks agree again
    for (g, completion, _), (m, _) in zip(items, solo):
        again, _ = g.step_masks(completion, [], J)
        np.testing.assert_array_equal(again[0], m[0])


def _walk_from(cache, spec, V, completion, rng, n):
    g = RequestGrammar(cache.compile(spec), V, cache.stop_token_ids)
    g.sync(completion)
    out = []
    for _ in range(n):
        mask, _ = g.step_masks(completion + out, [], 1)
        allowed = [t for t in range(V) if (mask[0, t // 32] >> (t % 32)) & 1]
        out.append(int(rng.choice(allowed)))
    return out
