"""The shipped 3-module model's drafts keep their acceptance in FP8.

Paired on the same text: the MTP modules quantized with `quantize_fp8` (its 192-wide layers
take 64 x 64 blocks, or one scale per output channel) and the target left bf16, so greedy
decoding commits exactly the bf16 model's tokens and only the drafts can change; their
acceptance stays within 2 points of the bf16 drafts'. (The whole model in FP8 decodes other
text, whose acceptance differs for that reason: docs/fp8.md gives those numbers.)"""

import jax.numpy as jnp
import pytest

import mtpjax
import mtpjax.model.quantize
from mtpjax.assets import MTP3_MODEL, tiny_model_path, tiny_model_prompts
from mtpjax.checkpoint.pretrained import load_pretrained


@pytest.fixture(scope="module")
def shipped():
    path = tiny_model_path(MTP3_MODEL)
    return load_pretrained(path, jnp.bfloat16), tiny_model_prompts(path)


def _run(params, ckpt, prompts):
    spec = mtpjax.SpecConfig(num_speculative_tokens=3, method="chain")
    # min_token_bucket=64 (16 rows x 4 tokens): every decode step, the last ones of fewer rows
    # too, runs one program; with the prefill's, two compiles per run, not five
    llm = mtpjax.LLM(params, ckpt.cfg, spec, tokenizer=ckpt.tokenizer,
                     eos_token_id=ckpt.eos_token_id, num_pages=512, max_num_seqs=len(prompts),
                     max_num_batched_tokens=2048, min_token_bucket=64)
    outs = llm.generate(prompts, mtpjax.SamplingParams(max_tokens=64))
    drafted = sum(o.num_draft_tokens for o in outs)
    assert drafted > 1000
    return [o.token_ids for o in outs], sum(o.num_accepted_draft_tokens for o in outs) / drafted


def test_fp8_drafts_accept_within_two_points_on_the_same_text(shipped):
    ckpt, prompts = shipped
    tokens, bf16 = _run(ckpt.params, ckpt, prompts)
    assert bf16 > 0.3                              # a trained head: the check has room to fail
    for block in ((64, 64), "channel"):
        q = mtpjax.quantize_fp8(ckpt.params, block)
        assert mtpjax.model.quantize.has_fp8(q["mtp"])
        params = {**ckpt.params, "mtp": q["mtp"]}  # FP8 drafts, the bf16 target
        got, fp8 = _run(params, ckpt, prompts)
        assert got == tokens                        # lossless: the target's tokens
        assert abs(fp8 - bf16) <= 0.02, (block, bf16, fp8)
