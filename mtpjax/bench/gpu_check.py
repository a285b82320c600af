"""GPU smoke check (not a test): Pallas and reference attention give the same greedy tokens,
through `generate` (uniform batches) and the engine (ragged batches), with float32 params, for a
GQA model (the paged / ragged kernels) and a DeepSeek-style MLA + MoE model (the MLA kernel).
A second table runs other paths against reference tokens (reference attention, and for MoE
`ragged_dot` experts): fused projections (GQA), the MoE layer's default GPU path (the routed
experts' SwiGLU on the Pallas grouped-matmul kernels) and the XLA tiled form (MLA + MoE), each
through `generate` and the engine. A third runs a bf16 MLA model (what the Mosaic-GPU MLA
kernel takes; float32 models take the Triton one) with each MLA kernel against bf16 reference
attention, reporting how long the greedy token streams agree (bf16 near-ties may flip).

    python -m mtpjax.bench.gpu_check [--tables kernels,opt-in,mla-bf16] [--mla-kernels mosaic]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

import mtpjax
from mtpjax.model.grouped_matmul import forced_path


TABLES = ("kernels", "opt-in", "mla-bf16")
MLA_KERNELS = ("mosaic", "triton")


def _choices(flag, value, allowed):
    """A comma-separated flag value -> its names in order, each one of `allowed`; otherwise
    refused (before main() changes any global setting)."""
    names = tuple(value.split(","))
    if set(names) - set(allowed):
        raise SystemExit(f"{flag} takes {', '.join(allowed[:-1])} and/or {allowed[-1]}, got "
                         f"{list(names)}")
    return names


def main(argv=None):
    ap = argparse.ArgumentParser(description="GPU smoke check (see the module docstring)")
    ap.add_argument("--tables", default=",".join(TABLES),
                    help="comma-separated: kernels (Pallas vs reference), opt-in (opt-in "
                         "paths), mla-bf16 (the MLA kernels on a bf16 model)")
    ap.add_argument("--mla-kernels", default=",".join(MLA_KERNELS),
                    help="the MLA kernels the mla-bf16 table runs (one alone fits a shorter "
                         "call)")
    args = ap.parse_args(argv)
    tables = _choices("--tables", args.tables, TABLES)
    mla_kernels = _choices("--mla-kernels", args.mla_kernels, MLA_KERNELS)
    # True float32 matmuls: with GPU's default (TF32) precision the two attention paths round
    # differently and near-ties flip (seen on the H100: one token of 192 with a top-2 logit gap
    # of 0.006), which says nothing about the kernels.
    jax.config.update("jax_default_matmul_precision", "highest")
    cfg = mtpjax.ModelConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024,
                             num_layers=4, num_heads=8, num_kv_heads=2, head_dim=128,
                             num_mtp_layers=2)
    mla = mtpjax.ModelConfig(model_type="deepseek_v3", vocab_size=4096, hidden_size=512,
                             intermediate_size=1024, num_layers=3, num_heads=16, num_kv_heads=16,
                             attention_kind="mla",
                             mla=mtpjax.MLAConfig(
                                 q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32,
                                 qk_rope_head_dim=32, v_head_dim=32, rope_interleave=True),
                             ffn_kind="moe",
                             moe=mtpjax.MoEConfig(
                                 n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                                 moe_intermediate_size=128, first_k_dense_replace=1, n_group=4,
                                 topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True),
                             num_mtp_layers=1)
    # Rows are printed as each finishes (flushed), so a failure later keeps the earlier rows.
    if "kernels" in tables:
        print("| model | method | K | generate pallas == reference | engine pallas == reference "
              "| of |", flush=True)
        for name, c in (("gqa", cfg), ("mla", mla)):
            for r in check(name, c):
                print("| " + " | ".join(map(str, r)) + " |", flush=True)
    if "mla-bf16" in tables:
        # bf16 (what the Mosaic-GPU MLA kernel takes) with width 128 + 64: near-tie flips are
        # possible in bf16, so the table reports how long the token streams agree.
        mla16 = dataclasses.replace(mla, mla=dataclasses.replace(mla.mla, qk_rope_head_dim=64),
                                    head_dim=64)
        print("\n| bf16 MLA model | kernel | generate: tokens agreeing with the reference "
              "(of) | engine: agreeing (of) |", flush=True)
        for r in check_mla_kernels_bf16(mla16, kernels=mla_kernels):
            print("| " + " | ".join(map(str, r)) + " |", flush=True)
    if "opt-in" in tables:
        print("\n| model | opt-in path | generate == reference | engine == reference | of |",
              flush=True)
        for name, c in (("gqa", cfg), ("mla", mla)):
            for r in check_opt_in(name, c, attention_impl="pallas"):
                print("| " + " | ".join(map(str, r)) + " |", flush=True)


OPT_IN = {   # model -> (label, forced MoE path or None, generate/LLM keyword arguments)
    "gqa": [("fuse_projections=True", None, {"fuse_projections": True})],
    "mla": [("MoE on the Pallas kernels (grouped SwiGLU; the GPU default)", "pallas", {}),
            ("MoE on the XLA tiled form", "tiled", {})],
}
REFERENCE_MOE = "ragged"          # the reference tokens' MoE experts: ragged_dot


@contextlib.contextmanager
def _traced_with(moe_path: str | None):
    """Programs traced inside run the MoE layer on `moe_path` (`forced_path`); the choice is
    read at trace time, so JAX's caches are cleared on the way in and out."""
    with forced_path(moe_path):
        jax.clear_caches()
        try:
            yield
        finally:
            jax.clear_caches()


def _model_inputs(cfg, num_prompts=8):
    params = mtpjax.init_params(cfg, jax.random.PRNGKey(0), jnp.float32, std=0.05)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, int(n)).tolist()
               for n in rng.integers(5, 120, num_prompts)]
    return params, prompts


def check_opt_in(name, cfg, attention_impl="pallas", max_new=24, num_prompts=8):
    """Each path of `OPT_IN[name]` against reference tokens (reference attention, ragged_dot
    experts, other paths default), chain K=3, through generate and the engine. Rows (model,
    label, generate matches, engine matches, prompts)."""
    params, prompts = _model_inputs(cfg, num_prompts)
    spec = mtpjax.SpecConfig(num_speculative_tokens=3)
    with _traced_with(REFERENCE_MOE):
        ref = mtpjax.generate(params, cfg, prompts, max_new_tokens=max_new, spec=spec,
                              attention_impl="reference").tokens
    same = lambda a, b: sum(x == y for x, y in zip(a, b))  # noqa: E731
    rows = []
    for label, moe_path, kw in OPT_IN[name]:
        with _traced_with(moe_path):
            gen = mtpjax.generate(params, cfg, prompts, max_new_tokens=max_new, spec=spec,
                                  attention_impl=attention_impl, **kw).tokens
            llm = mtpjax.LLM(params, cfg, spec, num_pages=1024, page_size=16, max_num_seqs=8,
                             max_num_batched_tokens=256, attention_impl=attention_impl,
                             warmup=False, **kw)
            eng = [o.token_ids for o in llm.generate(
                prompts, mtpjax.SamplingParams(max_tokens=max_new))]
        rows.append((name, label, same(ref, gen), same(ref, eng), len(prompts)))
    return rows


def _agreeing(ref, got):
    """Tokens of `got` that agree with `ref` before the first difference, summed over prompts."""
    total = 0
    for a, b in zip(ref, got):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        total += n
    return total


def check_mla_kernels_bf16(cfg, attention_impl="pallas", max_new=24, num_prompts=8,
                           kernels=MLA_KERNELS):
    """A bf16 MLA model through `generate` and the engine with each MLA kernel of `kernels`
    (MTPJAX_MLA_KERNEL, read at trace time: caches cleared around each), against reference
    attention in bf16. Rows (kernel, generate agreeing (of), engine agreeing (of))."""
    params, prompts = _model_inputs(cfg, num_prompts)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    spec = mtpjax.SpecConfig(num_speculative_tokens=3)
    ref = mtpjax.generate(params, cfg, prompts, max_new_tokens=max_new, spec=spec,
                          attention_impl="reference").tokens
    of = sum(len(r) for r in ref)
    rows = []
    before = os.environ.get("MTPJAX_MLA_KERNEL")
    try:
        for kernel in kernels:
            os.environ["MTPJAX_MLA_KERNEL"] = kernel
            jax.clear_caches()
            gen = mtpjax.generate(params, cfg, prompts, max_new_tokens=max_new, spec=spec,
                                  attention_impl=attention_impl).tokens
            llm = mtpjax.LLM(params, cfg, spec, num_pages=1024, page_size=16, max_num_seqs=8,
                             max_num_batched_tokens=256, attention_impl=attention_impl,
                             warmup=False)
            eng = [o.token_ids for o in llm.generate(
                prompts, mtpjax.SamplingParams(max_tokens=max_new))]
            rows.append(("mla", kernel, f"{_agreeing(ref, gen)} ({of})",
                         f"{_agreeing(ref, eng)} ({of})"))
    finally:
        if before is None:
            os.environ.pop("MTPJAX_MLA_KERNEL", None)
        else:
            os.environ["MTPJAX_MLA_KERNEL"] = before
        jax.clear_caches()
    return rows


def check(name, cfg):
    params, prompts = _model_inputs(cfg)
    rows = []
    for method, K in (("chain", 3),):
        spec = mtpjax.SpecConfig(num_speculative_tokens=K, method=method)
        ref = mtpjax.generate(params, cfg, prompts, max_new_tokens=24, spec=spec,
                              attention_impl="reference").tokens
        pal = mtpjax.generate(params, cfg, prompts, max_new_tokens=24, spec=spec,
                              attention_impl="pallas").tokens
        llm = mtpjax.LLM(params, cfg, spec, num_pages=1024, page_size=16, max_num_seqs=8,
                         max_num_batched_tokens=256, attention_impl="pallas",
                         warmup=False)   # compile only the buckets this check uses
        eng = [o.token_ids for o in llm.generate(prompts, mtpjax.SamplingParams(max_tokens=24))]
        same = lambda a, b: sum(x == y for x, y in zip(a, b))
        rows.append((name, method, K, same(ref, pal), same(ref, eng), len(prompts)))
    return rows


if __name__ == "__main__":
    main()
