"""Subprocess side of tests/parallel/test_dp_attention.py: runs with N fake CPU devices and prints
one JSON line of results. `python tests/dp_attention_cases.py CASE`; XLA_FLAGS must be set by
the caller before this starts (jax reads them at import)."""

from __future__ import annotations

import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import mtpjax  # noqa: E402
from mtpjax import SamplingParams, SpecConfig  # noqa: E402

_COLLECTIVE = r"(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("


def ds_model(seed: int, vocab_size: int = 48):
    """The suite's tiny DeepSeek-V3 (MLA + MoE, a dense first layer, one MTP module) with a
    non-zero routing correction bias (the biased routing is exercised)."""
    from conftest import tiny_mla_moe_config
    cfg = tiny_mla_moe_config(vocab_size)
    params = mtpjax.init_params(cfg, jax.random.PRNGKey(seed), std=0.3)
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: (0.2 * jax.random.normal(jax.random.PRNGKey(seed + 7), a.shape)
                         if "router_bias" in jax.tree_util.keystr(path) else a), params)
    return cfg, params


def collectives(hlo: str) -> list:
    """[kind, result shape] of every collective in a compiled HLO text."""
    out = []
    for line in hlo.split("\n"):
        m = re.search(r"= (.+?) " + _COLLECTIVE, line)
        if m:
            out.append([m.group(2), m.group(1)])
    return out


def case_moe() -> dict:
    """The DP-attention MoE layer under shard_map on (2, 1) and (4, 1) meshes against one
    device's layer: three seeds, padding rows on every device; its compiled collectives."""
    from mtpjax.model.backend import SplitTokens
    from mtpjax.model.moe import MOE
    from mtpjax.parallel.dp_attention import param_partition_specs
    from mtpjax.parallel.kernels import shard_map_compat
    out = []
    for d in (2, 4):
        mesh = mtpjax.make_mesh(data_parallel=d)
        n_local = 5
        split = SplitTokens("data", d)
        f = hlo = None
        for seed in range(3):
            cfg, params = ds_model(seed)
            p = params["layers"][1]                      # layer 0 is dense
            N = d * n_local
            x = jax.random.normal(jax.random.PRNGKey(seed + 10), (N, cfg.hidden_size))
            valid = np.array(jax.random.bernoulli(jax.random.PRNGKey(seed + 20), 0.7, (N,)))
            valid[0] = True
            ref = np.asarray(MOE(p, x, cfg, valid))
            specs = param_partition_specs(params, cfg, mesh)["layers"][1]
            if f is None:                                # one program per mesh (same shapes)
                f = jax.jit(shard_map_compat(
                    lambda p, x, v: MOE(p, x, cfg, v, split), mesh=mesh,
                    in_specs=(specs, P("data"), P("data")), out_specs=P("data"))).lower(
                    p, x, valid).compile()
                hlo = f.as_text()
            got = np.asarray(f(p, x, valid))
            out.append({"d": d, "seed": seed, "max_err": float(np.max(np.abs(got - ref))),
                        "scale": float(np.max(np.abs(ref))),
                        "padding_rows": int((~valid).sum()),
                        "collectives": collectives(hlo),
                        "w_gate_local": list(specs["w_gate"]),
                        "n_local": n_local, "E": cfg.hidden_size,
                        "k": cfg.moe.num_experts_per_tok})
    # FP8 weights (16 x 16 blocks): the experts' values and scales split alike
    from mtpjax import quantize_fp8
    cfg, params = ds_model(0)
    params = quantize_fp8(params, (16, 16))
    mesh = mtpjax.make_mesh(data_parallel=2)
    p = params["layers"][1]
    x = jax.random.normal(jax.random.PRNGKey(3), (8, cfg.hidden_size))
    valid = np.arange(8) % 4 != 3
    ref = np.asarray(MOE(p, x, cfg, valid))
    specs = param_partition_specs(params, cfg, mesh)["layers"][1]
    split = SplitTokens("data", 2)
    got = np.asarray(jax.jit(shard_map_compat(
        lambda p, x, v: MOE(p, x, cfg, v, split), mesh=mesh,
        in_specs=(specs, P("data"), P("data")), out_specs=P("data")))(p, x, valid))
    fp8 = {"max_err": float(np.max(np.abs(got - ref))), "scale": float(np.max(np.abs(ref))),
           "w_gate_specs": [list(specs["w_gate"].values), list(specs["w_gate"].scale)]}
    return {"moe": out, "moe_fp8": fp8}


PROMPTS = [[3, 5, 7, 9, 11], [2, 4, 6], [1, 2, 3, 4, 5, 6, 7], [8, 9], [4, 4, 4, 4, 4, 4],
           [7], [10, 11, 12], [5, 6, 7, 8]]
NEW = 6


def case_generate() -> dict:
    """mtpjax.generate with layout="dp_attention" against one device's tokens and statistics:
    plain on (2, 1); chain MTP (K = 2) on (4, 1) with every other request's drafts forced to
    the plain continuation (accepted: multi-token steps) and the others the MTP module's, one
    request sampled with its own seed. 8 prompts of uneven lengths (devices hold different
    token counts), one request stopping early by max_tokens; and the errors for bad batches.
    The decode loop's compiled collectives of both runs."""
    cfg, params = ds_model(0)
    greedy = [SamplingParams(max_tokens=3 if i == 2 else NEW) for i in range(len(PROMPTS))]
    # chain: request 5 samples (temperature 1, top-k 20, its own seed) on its device
    sampled = [SamplingParams(max_tokens=NEW, temperature=1.0, top_k=20, seed=7) if i == 5
               else sp for i, sp in enumerate(greedy)]
    out = {}
    plain = mtpjax.generate(params, cfg, PROMPTS, max_new_tokens=NEW, sampling=greedy,
                            page_size=4)
    L = max(len(p) for p in PROMPTS) + NEW + 8
    forced = np.zeros((len(PROMPTS), L), np.int32)
    for b, (p, t) in enumerate(zip(PROMPTS, plain.tokens)):
        forced[b, :len(p) + len(t)] = p + t
    chain = dict(spec=SpecConfig(num_speculative_tokens=2), forced_drafts=forced,
                 draft_source=["forced" if b % 2 == 0 else "model" for b in range(len(PROMPTS))])
    from mtpjax.parallel import dp_generate
    loop, hlo = dp_generate._loop, []

    def spy(*args, **kw):                      # the decode loop's compiled collectives
        compiled = loop.lower(*args, **kw).compile()
        hlo.append(compiled.as_text())
        return compiled(args[0], *args[3:])     # the statics (cfg, spec, keywords) are in it

    for mode, d, kw, sps, ref in (("plain", 2, {}, greedy, plain),
                                  ("chain", 4, chain, sampled, None)):
        if ref is None:
            ref = mtpjax.generate(params, cfg, PROMPTS, max_new_tokens=NEW, sampling=sps,
                                  page_size=4, **kw)
        dp_generate._loop, hlo[:] = spy, []
        try:
            got = mtpjax.generate(params, cfg, PROMPTS, max_new_tokens=NEW, sampling=sps,
                                  page_size=4, mesh=mtpjax.make_mesh(data_parallel=d),
                                  layout="dp_attention", **kw)
        finally:
            dp_generate._loop = loop
        rows = [b for b, sp in enumerate(sps) if sp.temperature == 0]
        out[f"{mode} d={d}"] = {"equal": got.tokens == ref.tokens,
                                "equal_plain": all(got.tokens[b] == plain.tokens[b]
                                                   for b in rows),
                                "sampled_rows": len(sps) - len(rows),
                                "stats_equal": got.stats == ref.stats, "stats": got.stats,
                                "loop_collectives": collectives(hlo[0])}
    errors = {}
    mesh = mtpjax.make_mesh(data_parallel=2)
    for name, kw in (("odd batch", dict(prompts=PROMPTS[:3])),
                     ("odd pages", dict(prompts=PROMPTS[:2], num_pages=7)),
                     ("tensor parallel", dict(prompts=PROMPTS[:2],
                                              mesh=mtpjax.make_mesh(tensor_parallel=2)))):
        try:
            mtpjax.generate(params, cfg, kw.pop("prompts"), max_new_tokens=2,
                            **{"mesh": mesh, "layout": "dp_attention", **kw})
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    out["errors"] = errors
    return out


def case_placement() -> dict:
    """Where the layout puts params and a slot state on (4, 1): per-device shapes."""
    from mtpjax.cache import init_cache
    from mtpjax.parallel.dp_attention import DP_ATTENTION_RULES, param_shardings_like
    from mtpjax.parallel.placement import create_sharded, place
    from mtpjax.speculative.mixed_step import SlotState
    cfg, params = ds_model(0)
    mesh = mtpjax.make_mesh(data_parallel=4)
    spec = SpecConfig(num_speculative_tokens=2)
    placed = jax.tree.map(place, params, param_shardings_like(params, cfg, mesh))
    slots = create_sharded(lambda: SlotState.create(cfg, spec, init_cache(cfg, 16, 4), 8),
                           cfg, mesh, DP_ATTENTION_RULES)
    shard = lambda x: [list(x.shape), list(x.addressable_shards[0].data.shape)]
    return {"w_gate": shard(placed["layers"][1]["w_gate"]),
            "wkv_b": shard(placed["layers"][1]["wkv_b"]),
            "router": shard(placed["layers"][1]["router"]),
            "mtp_w_up": shard(placed["mtp"][0]["block"]["w_up"]),
            "pages": shard(slots.cache.target[0].latent),
            "mtp_pages": shard(slots.cache.mtp[0].latent),
            "seq_len": shard(slots.seq_len), "hist_hidden": shard(slots.hist_hidden),
            "draft_probs": shard(slots.draft_probs)}


if __name__ == "__main__":
    case = sys.argv[1]
    result = {"moe": case_moe, "generate": case_generate, "placement": case_placement,
              "all": lambda: {**case_moe(), "generate": case_generate(),
                              "placement": case_placement()}}[case]()
    print("RESULT " + json.dumps(result))
