"""Layer kinds: a new FFN kind is added from this file alone (its module = the class below, one
registration line, the config value), and every path runs it: the plain forward, generate with
and without MTP drafts, the engine and the checkpoint key table. Also the backend's errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtpjax
from mtpjax.checkpoint.hf_keys import key_table
from mtpjax.model.dense_ffn import DenseFFN
from mtpjax.model.kinds import FFN_KINDS, register_ffn_kind


class GeluFFN(DenseFFN):
    """A toy kind: the dense FFN's leaves and key rows with a GELU activation."""
    name = "gelu_toy"
    activation = staticmethod(jax.nn.gelu)


register_ffn_kind(GeluFFN())

BASE = mtpjax.ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2,
                          num_heads=4, num_kv_heads=2, num_mtp_layers=1)
TOY = dataclasses.replace(BASE, ffn_kind="gelu_toy")


def test_unknown_kind_is_a_clear_error():
    with pytest.raises(ValueError, match=r"FFN kind 'nope' is not registered; known: .*dense"):
        dataclasses.replace(BASE, ffn_kind="nope")
    with pytest.raises(ValueError, match=r"attention kind 'linear' is not registered; known: .*mla"):
        dataclasses.replace(BASE, attention_kind="linear")
    # a registered kind whose sub-config is missing names it
    with pytest.raises(ValueError, match=r"attention_kind 'mla' needs mla= \(a MLAConfig"):
        dataclasses.replace(BASE, attention_kind="mla")


@pytest.mark.parametrize("seed", [3])
def test_toy_kind_runs_through_every_path(seed):
    assert "gelu_toy" in FFN_KINDS
    params = mtpjax.init_params(TOY, jax.random.PRNGKey(seed), std=0.2)
    # same leaves as dense, different function: the kind is really used
    dense = mtpjax.forward(params, BASE, jnp.asarray([[1, 2, 3, 4]]))
    toy = mtpjax.forward(params, TOY, jnp.asarray([[1, 2, 3, 4]]))
    assert not np.allclose(dense, toy)
    prompts = [[5, 6, 7], [8, 9]]
    greedy = mtpjax.SamplingParams(temperature=0.0)
    plain = mtpjax.generate(params, TOY, prompts, max_new_tokens=8, sampling=greedy).tokens
    spec = mtpjax.generate(params, TOY, prompts, max_new_tokens=8, sampling=greedy,
                           spec=mtpjax.SpecConfig(num_speculative_tokens=2),
                           draft_source="random").tokens
    assert spec == plain
    # plain greedy == argmax of the from-scratch (causal) forward at every generated position:
    # one forward over prompt + tokens, not one compile per length
    seq = list(prompts[0]) + plain[0][:-1]
    logits = mtpjax.forward(params, TOY, jnp.asarray([seq]))[0]
    n = len(prompts[0])
    assert np.asarray(jnp.argmax(logits[n - 1:], axis=-1)).tolist() == plain[0]
    llm = mtpjax.LLM(params, TOY, mtpjax.SpecConfig(num_speculative_tokens=2), num_pages=32,
                     page_size=4, max_num_seqs=2, max_num_batched_tokens=32)
    assert [o.token_ids for o in llm.generate(prompts, mtpjax.SamplingParams(max_tokens=8))] == plain


def test_key_table_rows_come_from_the_kinds():
    table = key_table(TOY)
    assert table.slots["model.layers.1.mlp.up_proj.weight"].path == ("layers", 1, "w_up")
    assert table.slots["model.layers.2.mlp.down_proj.weight"].path == ("mtp", 0, "block", "w_down")
    assert table.hf_shape("model.layers.0.mlp.gate_proj.weight") == (48, 32)


def test_explicit_pallas_refuses_an_unsupported_shape():
    params = mtpjax.init_params(BASE, jax.random.PRNGKey(0))   # head_dim 8: no kernel
    with pytest.raises(ValueError, match=r"do not support head_dim 8"):
        mtpjax.generate(params, BASE, [[1, 2]], max_new_tokens=2, attention_impl="pallas_interpret")
