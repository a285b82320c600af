"""Prompt logprobs: for each prompt token after the first, its logprob given the tokens before it
and the n most likely alternatives, under the request's processed distribution (the same
`sampling.processed_logprob_top` the generated tokens' logprobs use).

Computed by one extra target pass over the prompt (plain causal attention, no cache), dispatched
asynchronously when the request is added and read when its output is built. The engine's step
computes logits only where it samples (a chunk's last token), so giving every prompt token
logits there would widen the lm_head matmul of every step for every engine; a separate pass
costs only the requests that ask, about one uncached prefill of their prompt. Lengths are padded
to a power of two (>= 16), one compile per length and mode; right padding cannot change earlier
positions (causal). The vocabulary pass runs over blocks of positions so a long prompt never
holds [T, V] float32 logits at once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mtpjax.config import ModelConfig, SamplingParams
from mtpjax.engine.logprobs import TokenLogprobs
from mtpjax.model.transformer import final_hidden, logits_from_hidden
from mtpjax.sampling import processed_logprob_top, top_p_array

BLOCK = 256          # positions per vocabulary pass


def padded_length(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("cfg", "n", "mode"))
def _prompt_top(params, cfg: ModelConfig, tokens, temperature, top_k, top_p, *, n: int,
                mode: str):
    """tokens int32[T] (T a multiple of 16) -> (chosen f32[T-1], ids int32[T-1, n],
    vals f32[T-1, n]): entry i scores tokens[i + 1] from the logits at position i."""
    T = tokens.shape[0]
    hidden = final_hidden(params, cfg, tokens[None])[0]                   # [T, E]
    nxt = jnp.concatenate([tokens[1:], jnp.zeros((1,), jnp.int32)])       # [T]
    C = min(BLOCK, T)
    t, k, p = (jnp.reshape(a, (1,)) for a in (temperature, top_k, top_p))

    def block(args):
        h, tok = args                                                      # [C, E], [C]
        chosen, vals, ids = processed_logprob_top(logits_from_hidden(params, h)[None], tok[None],
                                                  t, k, p, n, mode)
        return chosen[0], ids[0], vals[0]

    chosen, ids, vals = jax.lax.map(block, (hidden.reshape(T // C, C, -1), nxt.reshape(T // C, C)))
    flat = lambda a: a.reshape((T,) + a.shape[2:])[:T - 1]                 # noqa: E731
    return flat(chosen), flat(ids), flat(vals)


class PromptLogprobs:
    """A request's prompt logprobs in flight: device arrays until `result()` reads them."""

    def __init__(self, params, cfg: ModelConfig, prompt: list[int], sp: SamplingParams,
                 n_max: int):
        self.n = sp.prompt_logprobs
        T = padded_length(len(prompt))
        tokens = np.zeros(T, np.int32)
        tokens[:len(prompt)] = prompt
        self.tokens, self._dicts = prompt, None
        mode = "filter" if sp.temperature > 0 else "greedy"
        self._arrays = _prompt_top(params, cfg, jnp.asarray(tokens),
                                   np.float32(sp.temperature), np.int32(sp.top_k),
                                   top_p_array(sp.top_p), n=max(n_max, 1), mode=mode)

    def result(self) -> list:
        """vLLM's layout: [None, {prompt[1]: lp, ...top n}, ..., {prompt[L-1]: ...}] (a new
        list each call; the arrays are read once)."""
        if self._dicts is None:
            chosen, ids, vals = (np.asarray(a) for a in self._arrays)
            lps = TokenLogprobs(self.n)
            lps.append_step(self.tokens[1:], (chosen[None], ids[None], vals[None]), 0)
            self._dicts, self._arrays = list(lps), None
        return [None] + [dict(d) for d in self._dicts]
