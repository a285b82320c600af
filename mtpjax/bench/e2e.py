"""End-to-end decode speed at a real model shape: `generate` and the `LLM` engine, plain and with
MTP, against Hugging Face transformers on the same GPU, plus engine start-up (cold and warm).

    mtpjax bench e2e --model-shape llama3-8b [--batch 1,32] [--prompt-len 128] [--new-tokens 128]
                     [--k 3] [--accept-rate 0.8] [--warm-start] [--tensor-parallel N] [--out DIR]
    (= python -m mtpjax.bench.e2e ...; `--model-shape tiny` runs on the CPU in the tests)

Weights are random bf16 (std 0.02); MTP rows use K = 3 chained drafts with the benchmark-only
synthetic acceptance (each draft accepted with probability `--accept-rate`), so their tokens per
verify step are what a real model with that acceptance would commit. Rows, at each batch size:

  generate plain / generate MTP   `mtpjax.generate`, one on-device while_loop. Decode time =
        t(full) - t(prefill only), each the median of `--repeats` interleaved calls after one
        untimed full call (compiles). The prefill-only call is the same program on the same
        inputs (same max_new_tokens = N, so nothing recompiles), except that each request gets
        its own first token (greedy, known from the full call) as a stop token: it runs the
        same cache set-up, prefill (and first draft pass) and readback and stops before the
        loop's first iteration, so the difference is the loop alone. ms/step = decode time /
        loop iterations (`stats`).
  engine plain / engine MTP       `mtpjax.LLM` (continuous batching, async scheduling), all
        requests added at once; the clock starts when every request has its first token (all
        prefills done) and stops when the last finishes (in-flight step flushed). ms/step =
        that time / engine steps in it. One untimed pass of the same workload first (compiles
        the buckets it uses); median of `--repeats` passes.
  HF                              `transformers.LlamaForCausalLM` at the same shape, random bf16
        on CUDA, `generate(cache_implementation="static")` (static cache; transformers then
        compiles the decoding forward with torch.compile), greedy, min_new_tokens =
        max_new_tokens, in its own Python process (torch and JAX never share one). A
        StoppingCriteria records a CUDA event after every token (no sync): ms/step = GPU time
        from the first token's event to the last / (N - 1), median of `--repeats` calls after
        a compiling one. Skipped when JAX runs on the CPU or torch + CUDA + transformers do
        not import.
  start-up cold                   seconds from `LLM(..., warmup=True)` (MTP, largest batch) to
        the first token of one prompt, with an empty persistent compilation cache (a fresh
        folder unless the user set one: the row says which), warm-up of every bucket included.
  start-up warm (--warm-start)    the same in a second Python process reading that cache
        (after --background-startup --no-blocking-startup: a background start reading it).
  start-up background (--background-startup)  seconds from `LLM(..., warmup="background")` to
        the first token (only the largest bucket's "filter" program compiled first; the step is
        padded up to it), and until the background threads have compiled every bucket
        (`--first-token-only`: not waited for), in a fresh Python process with its own empty
        compilation cache (cold).

Columns: ms/step; tok/s = decode tokens committed / decode time (whole batch); acc len = mean
acceptance length (tokens per verify step; 1 without MTP); floor = bytes that must move per step
/ copy bandwidth; % floor = floor / ms/step. Bytes per step (bf16): target layers (attention,
MLP, norms) + final norm + lm_head, read once; embedding rows gathered (B(K+1) rows) are
negligible and not counted; with MTP add K draft passes, each reading the MTP module (block,
eh_proj, norms) and the lm_head; plus the target's KV read once: B x ctx x layers x 2 x kv_heads
x head_dim x 2 bytes at the mean decode context ctx = prompt + N/2 (the MTP modules' own KV, one
layer per pass, is left out). Copy bandwidth: a jitted copy of `--copy-mib` MiB (default 1 GiB),
read + written bytes / time, 10 chained copies per round, median of 5 rounds after 1 s of
untimed copies (clock ramp-up), in this process.

Several devices: `--tensor-parallel N` (and `--data-parallel M`) run every mtpjax row on a
("data", "model") mesh of M x N devices (`mtpjax.make_mesh`, docs/parallel.md); the floor
columns stay single-device numbers (bytes / one device's copy bandwidth). `--replicas R` runs
the engine rows as R independent engines (`mtpjax.DataParallelLLM`, each on --tensor-parallel
devices) sharing the batch; their batch column and floor are one replica's share.

Robustness: each row runs in its own try/except (a failing row or peer is reported, not fatal;
the warm start and HF run in child processes with `--child-timeout`); progress lines go to
stdout with flush; the markdown table is printed last; `--out DIR` gets e2e.json with every
number, rewritten after each row. The persistent compilation cache goes to a fresh temporary folder
(removed at the end; `--cache-dir` keeps one) so that the cold start is cold. JAX GPU memory
preallocation is turned off (XLA_PYTHON_CLIENT_PREALLOCATE=false unless set) so the warm-start
process and torch fit beside this one.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

_PROCESS_START = time.perf_counter()     # a child's limit counts from its start

from mtpjax.model.fused import MODES as FUSION_MODES

SHAPES = {
    # Llama 3 8B: untied lm_head, plus one MTP module of the same layer shape
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                      rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
                      tie_word_embeddings=False, num_mtp_layers=1),
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                 rms_norm_eps=1e-5, max_position_embeddings=1024, tie_word_embeddings=False,
                 num_mtp_layers=1),
    # DeepSeek-V2-Lite (its config.json) + one DeepSeek MTP module (an MLA + MoE block): MLA
    # without q_lora, latent 512 + rope 64, 64 routed experts (6 per token) + 2 shared, 27 layers
    # of which the first is dense
    "deepseek-v2-lite": dict(model_type="deepseek_v2", vocab_size=102400, hidden_size=2048,
                             intermediate_size=10944, num_layers=27, num_heads=16,
                             num_kv_heads=16, attention_kind="mla",
                             mla=dict(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                                      qk_rope_head_dim=64, v_head_dim=128),
                             ffn_kind="moe",
                             moe=dict(n_routed_experts=64, num_experts_per_tok=6,
                                      n_shared_experts=2, moe_intermediate_size=1408,
                                      first_k_dense_replace=1, routing="softmax_greedy",
                                      n_group=1, topk_group=1, norm_topk_prob=False,
                                      routed_scaling_factor=1.0),
                             rope_theta=10000.0, rms_norm_eps=1e-6,
                             max_position_embeddings=4096, tie_word_embeddings=False,
                             num_mtp_layers=1),
    # DeepSeek-V3's real layer dimensions (MLA with 128 heads and q_lora 1536; 256 routed
    # experts, 8 per token, group-limited sigmoid routing with bias, 1 shared expert) at a depth
    # one GPU holds: 3 dense + 3 MoE layers + one MTP module, ~97 GB of bf16 weights (an H200)
    "deepseek-v3-slice": dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168,
                              intermediate_size=18432, num_layers=6, num_heads=128,
                              num_kv_heads=128, attention_kind="mla",
                              mla=dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                                       qk_rope_head_dim=64, v_head_dim=128,
                                       rope_interleave=True),
                              ffn_kind="moe",
                              moe=dict(n_routed_experts=256, num_experts_per_tok=8,
                                       n_shared_experts=1, moe_intermediate_size=2048,
                                       first_k_dense_replace=3,
                                       routing="sigmoid_group_limited_bias", n_group=8,
                                       topk_group=4, norm_topk_prob=True,
                                       routed_scaling_factor=2.5),
                              rope_theta=10000.0, rms_norm_eps=1e-6,
                              max_position_embeddings=4096, tie_word_embeddings=False,
                              num_mtp_layers=1),
    "tiny-mla-moe": dict(model_type="deepseek_v2", vocab_size=128, hidden_size=64,
                         intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=4,
                         attention_kind="mla",
                         mla=dict(q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
                                  qk_rope_head_dim=8, v_head_dim=16),
                         ffn_kind="moe",
                         moe=dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                                  moe_intermediate_size=32, first_k_dense_replace=1,
                                  routing="softmax_greedy", n_group=1, topk_group=1,
                                  norm_topk_prob=False, routed_scaling_factor=1.0),
                         rope_theta=10000.0,
                         rms_norm_eps=1e-6, max_position_embeddings=1024,
                         tie_word_embeddings=False, num_mtp_layers=1),
}
PAGE_SIZE = 16
ROWS = ("generate plain", "generate MTP", "engine plain", "engine MTP", "HF")
_T0 = time.perf_counter()
_EVENTS: collections.Counter = collections.Counter()
_LISTENING = False
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"


def log(msg: str) -> None:
    print(f"[e2e {time.perf_counter() - _T0:7.1f}s] {msg}", flush=True)


def _listen() -> None:
    """Counts programs built (XLA compilations and persistent-cache loads both record the
    backend-compile event) and persistent-cache hits (jax.monitoring), once per process."""
    global _LISTENING
    if not _LISTENING:
        import jax
        jax.monitoring.register_event_listener(lambda name, **kw: _EVENTS.update([name]))
        jax.monitoring.register_event_duration_secs_listener(
            lambda name, secs, **kw: _EVENTS.update([name]))
        _LISTENING = True


# ---- model, bytes, bandwidth --------------------------------------------------------------------

def model_config(shape: str):
    import mtpjax
    fields = dict(SHAPES[shape])
    return mtpjax.ModelConfig(model_type=fields.pop("model_type", "llama"), **fields)


def weight_bytes(cfg, itemsize: int = 2, fp8=None) -> dict:
    """Bytes of the weights a decode step reads, from the config (bf16: 2 bytes). fp8: the
    quantize_fp8 block ((bE, bN) or "channel") when the projections are FP8: 1 byte each plus
    their float32 scales."""
    if cfg.attention_kind == "mla" or cfg.ffn_kind == "moe" or fp8:
        from mtpjax.model.weight_bytes import weight_bytes_by_part
        return weight_bytes_by_part(cfg, itemsize, fp8)
    E, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    layer = 2 * E * H * D + 2 * E * KVH * D + 3 * E * I + 2 * E      # q, o, k, v, MLP, 2 norms
    mtp = layer + 2 * E * E + 3 * E                              # + eh_proj, enorm/hnorm/out norm
    return {"target_layers": cfg.num_layers * layer * itemsize, "final_norm": E * itemsize,
            "lm_head": V * E * itemsize, "mtp_module": mtp * itemsize,
            "embed_table_not_counted": V * E * itemsize}


def touched_experts(cfg, tokens: int) -> float:
    """Expected distinct routed experts chosen by `tokens` tokens routing uniformly at random
    (random weights): X (1 - (1 - k/X)^tokens)."""
    from mtpjax.model.weight_bytes import touched_experts as touched
    return float(touched(cfg.moe.n_routed_experts, cfg.moe.num_experts_per_tok, tokens))


def step_bytes(w: dict, cfg, batch: int, ctx: float, K: int, draft_vocab: int = 0) -> dict:
    """draft_vocab: N > 0 when the draft passes read an [E, N] slice of the lm_head. MoE: the
    target pass reads the experts touched by batch x (K + 1) tokens per MoE layer, each draft
    pass those of `batch` tokens (a lower bound: the first draft pass covers a window)."""
    if cfg.attention_kind == "mla":
        latent = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
        kv = batch * ctx * cfg.num_layers * latent * 2
    else:
        kv = batch * ctx * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    target = w["target_layers"] + w["final_norm"] + w["lm_head"]
    head = w["lm_head"] * draft_vocab // cfg.vocab_size if draft_vocab else w["lm_head"]
    drafts = K * (w["mtp_module"] + head)
    if w.get("expert"):
        target += w["target_moe_layers"] * w["expert"] * touched_experts(cfg, batch * (K + 1))
        drafts += K * w["mtp_moe_layers"] * w["expert"] * touched_experts(cfg, batch)
    return {"weights": target, "mtp_drafts": drafts, "kv": kv, "total": target + drafts + kv}


def mixed_step_bytes(w: dict, cfg, batch: int, ctx: float, passes_used: dict,
                     draft_vocab: int = 0) -> dict:
    """`step_bytes` of an engine whose steps ran different draft passes (adaptive K):
    passes_used {passes: steps} -> each part averaged over the steps, a step of p passes
    counted as a fixed K = p step (it verifies at most p drafts)."""
    total = sum(passes_used.values())
    if total <= 0:
        raise ValueError(f"passes_used must count at least one step, got {passes_used}")
    parts = [(n / total, step_bytes(w, cfg, batch, ctx, p, draft_vocab))
             for p, n in passes_used.items()]
    return {k: sum(share * b[k] for share, b in parts) for k in parts[0][1]}


def copy_bandwidth(mib: int, rounds: int = 5, chain: int = 10, warmup_s: float = 1.0) -> float:
    """Bytes/s of a jitted array copy (read + written), median of `rounds` of `chain` copies,
    after `warmup_s` seconds of untimed copies. Without the warm-up the first process of a
    device call once read 2.52 TB/s where every other reading of that lease was 2.86-2.97, and
    its floors came out 14% too high (docs/benchmarks.md); a device that has not ramped its
    clocks up is the likely cause, which the warm-up removes."""
    import jax
    import jax.numpy as jnp
    n = mib * 2 ** 20 // 2
    x = jnp.ones((n,), jnp.bfloat16)
    copy = jax.jit(lambda a: a.copy())
    jax.block_until_ready(copy(x))
    t_end = time.perf_counter() + warmup_s
    while time.perf_counter() < t_end:
        y = x
        for _ in range(chain):
            y = copy(y)
        jax.block_until_ready(y)
    times = []
    for _ in range(rounds):
        y = x
        t0 = time.perf_counter()
        for _ in range(chain):
            y = copy(y)
        jax.block_until_ready(y)
        times.append(time.perf_counter() - t0)
        del y
    return 2 * n * 2 * chain / statistics.median(times)


# ---- rows ---------------------------------------------------------------------------------------

def prompts_for(cfg, batch: int, prompt_len: int, seed: int) -> list[list[int]]:
    import numpy as np
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.vocab_size, size=(batch, prompt_len)).tolist()


def spec_config(args):
    import mtpjax
    return mtpjax.SpecConfig(num_speculative_tokens=args.k, method="chain",
                             acceptance="synthetic", synthetic_accept_rate=args.accept_rate)


_MESHES: dict = {}


def mesh_of(args):
    """The ("data", "model") mesh of --data-parallel x --tensor-parallel (or --dp-attention N x
    1), None for one device."""
    if args.dp_attention:
        key = (args.dp_attention, 1, "dp_attention")
        if key not in _MESHES:
            import mtpjax
            _MESHES[key] = mtpjax.make_mesh(data_parallel=args.dp_attention)
        return _MESHES[key]
    key = (args.data_parallel, args.tensor_parallel)
    if key == (1, 1):
        return None
    if key not in _MESHES:
        import mtpjax
        _MESHES[key] = mtpjax.make_mesh(tensor_parallel=args.tensor_parallel,
                                        data_parallel=args.data_parallel)
    return _MESHES[key]


def layout_of(args):
    """generate's layout=: "dp_attention" under --dp-attention, else the sharding table's."""
    return "dp_attention" if args.dp_attention else None


def no_engine_dp_attention(args) -> None:
    if args.dp_attention:
        raise NotImplementedError("--dp-attention times the generate rows only: the engine "
                                  "(mtpjax.LLM) is not built for layout='dp_attention'")


def engine_kwargs(args, batch: int) -> dict:
    """Engine limits for `batch` requests. Token budget: a whole decode step, and enough prefill
    (up to 2048 tokens) that every prompt is in within a few steps, so the timed decode phase
    (which starts when every request has its first token) runs the whole batch."""
    K = args.k
    tokens = args.prompt_len + args.new_tokens + 4 * (K + 1)
    budget = max(batch * (K + 1), min(batch * args.prompt_len, 2048), args.prompt_len, 8)
    mnbt = args.max_num_batched_tokens or 1 << (budget - 1).bit_length()
    return dict(num_pages=batch * (math.ceil(tokens / PAGE_SIZE) + 1) + 4, page_size=PAGE_SIZE,
                max_num_seqs=batch, max_num_batched_tokens=mnbt, enable_prefix_caching=False,
                max_model_len=tokens, min_token_bucket=args.min_token_bucket)


def draft_vocab_of(spec):
    """Draft subset ids for a spec with draft_vocab_size (random weights: the first N ids)."""
    import numpy as np
    return None if spec is None or spec.draft_vocab_size is None else np.arange(
        spec.draft_vocab_size)


def time_generate(params, cfg, spec, prompts, args) -> dict:
    import mtpjax
    N = args.new_tokens

    def call(sampling=None):
        t0 = time.perf_counter()
        out = mtpjax.generate(params, cfg, prompts, max_new_tokens=N, spec=spec,
                              page_size=PAGE_SIZE, sampling=sampling, mesh=mesh_of(args),
                              steps_per_check=args.steps_per_check,
                              fuse_projections=args.fuse_projections,
                              draft_vocab=draft_vocab_of(spec), layout=layout_of(args))
        return out, time.perf_counter() - t0

    out, _ = call()                                  # compiles; greedy first tokens
    # The prefill-only call runs the same program: each request's own (greedy, deterministic)
    # first token is its stop token, so the loop ends before its first iteration.
    stop_first = [mtpjax.SamplingParams(stop_token_ids=(t[0],)) for t in out.tokens]
    full, pre = [], []
    for _ in range(args.repeats):                    # interleaved, so drift hits both
        out1, t = call(stop_first)
        pre.append(t)
        outN, t = call()
        full.append(t)
    if any(len(t) != 1 for t in out1.tokens):
        raise RuntimeError("the prefill-only call generated more than one token per request")
    steps_key = "draft_steps" if spec is not None else "decode_steps"
    steps = outN.stats[steps_key] - out1.stats.get(steps_key, 0)
    tokens = sum(map(len, outN.tokens)) - sum(map(len, out1.tokens))
    decode_s = statistics.median(full) - statistics.median(pre)
    res = dict(acc_len=outN.stats.get("mean_acceptance_length", 1.0), steps=steps,
               decode_tokens=tokens, prefill_s=statistics.median(pre),
               runs_s=dict(full=full, prefill=pre))
    if decode_s <= 0:
        return dict(res, ms_per_step=float("nan"), tok_per_s=float("nan"),
                    note="decode time below the timing noise: raise --new-tokens")
    return dict(res, ms_per_step=1e3 * decode_s / steps, tok_per_s=tokens / decode_s)


def engine_pass(llm, prompts, new_tokens: int, verify_k: int | None = None) -> dict:
    """One pass of the workload through generate_stream; times the decode phase. verify_k:
    each request's SamplingParams.num_speculative_tokens (None: the engine's K)."""
    import mtpjax
    sp = mtpjax.SamplingParams(max_tokens=new_tokens, num_speculative_tokens=verify_k)
    compiled0 = _EVENTS[BACKEND_COMPILE]
    started, outs = set(), []
    tokens = 0
    t0 = steps0 = tokens0 = None
    for ev in llm.generate_stream(prompts, sp):
        tokens += len(ev.new_token_ids)
        if ev.new_token_ids:
            started.add(ev.request_index)
        if ev.finished:
            outs.append(ev.output)
        if t0 is None and len(started) == len(prompts):
            t0, steps0, tokens0 = time.perf_counter(), llm.num_steps, tokens
    llm.flush()
    dt = time.perf_counter() - t0
    steps = llm.num_steps - steps0
    verify = sum(o.num_verify_steps for o in outs)
    acc = sum(o.num_accepted_draft_tokens + o.num_verify_steps for o in outs) / max(verify, 1)
    return dict(decode_s=dt, steps=steps, decode_tokens=tokens - tokens0,
                ms_per_step=_div(1e3 * dt, steps), tok_per_s=_div(tokens - tokens0, dt),
                acc_len=acc if llm.spec is not None else 1.0,
                compiled=_EVENTS[BACKEND_COMPILE] - compiled0)


def time_engine(params, cfg, spec, prompts, args) -> dict:
    import mtpjax
    no_engine_dp_attention(args)
    common = dict(warmup=False, fuse_projections=args.fuse_projections,
                  draft_vocab=draft_vocab_of(spec))
    if args.replicas > 1:            # independent engines (DataParallelLLM): batch per replica
        llm = mtpjax.DataParallelLLM(params, cfg, spec, data_parallel=args.replicas,
                                     tensor_parallel=args.tensor_parallel, **common,
                                     **engine_kwargs(args, -(-len(prompts) // args.replicas)))
    else:
        adaptive = None
        if args.adaptive_k and spec is not None:
            from mtpjax.speculative.adaptive import AdaptiveK
            adaptive = AdaptiveK()        # expert-aware on MoE shapes; k <= --k per request
        llm = mtpjax.LLM(params, cfg, spec, mesh=mesh_of(args), adaptive_k=adaptive, **common,
                         **engine_kwargs(args, len(prompts)))
    verify_k = args.verify_k if spec is not None else None
    engine_pass(llm, prompts, args.new_tokens, verify_k)       # compiles the buckets it uses
    loop = getattr(llm, "_loop", None)
    if loop is not None:
        loop.reset_host_split()
    out = compile_free_median(lambda: engine_pass(llm, prompts, args.new_tokens, verify_k),
                              args.repeats)
    if verify_k is not None:
        out["note"] = (out.get("note", "") + f" each request verifies <= {verify_k} of "
                       f"K={args.k} drafts;").strip()
    if loop is not None:
        host, wait = loop.host_split()
        # host work per step above the device's time leaves the GPU idle (wait near 0)
        out["note"] = (out.get("note", "") + f" host {1e3 * host:.2f} ms, waiting "
                       f"{1e3 * wait:.2f} ms per step;").strip()
    if args.adaptive_k and args.replicas == 1 and spec is not None:
        used = llm._loop.passes_used                   # over every pass, the first included
        out["passes_used"] = dict(used)                # the row's floor averages over them
        out["note"] = (out.get("note", "") + " draft passes per step: " + ", ".join(
            f"{p}: {n}" for p, n in sorted(used.items()))).strip()
        timed = llm._loop.step_times.summary()       # the step times the rule decided on
        out["note"] += "; step ms (times timed) by passes: " + ", ".join(
            f"b{b} p{p}: {1e3 * t:.2f} ({n})" for (b, p), (t, n) in timed.items())
        untimed = llm._loop.untimed_steps
        if untimed:
            out["note"] += "; not timed (passes, why): " + ", ".join(
                f"{p} {why}: {n}" for (p, why), n in sorted(untimed.items()))
        switched = llm._loop.switch_step_times          # steps right after a change of passes
        if switched:
            by_p = dict(collections.Counter(p for p, _ in switched))
            median = statistics.median(t for _, t in switched)
            out["note"] += (f"; after a switch: {1e3 * median:.2f} ms median of "
                            f"{len(switched)} (passes: {by_p})")
    return out


def compile_free_median(run_pass, repeats: int) -> dict:
    """The median by ms/step of `repeats` passes that compiled nothing (run_pass() -> a dict
    with "ms_per_step" and "compiled", the programs built during it).

    The engine is built without warm-up (every bucket would compile: minutes at real shapes),
    so a timed pass can meet a bucket the first pass did not (the synthetic acceptance differs
    per pass, and with it the draft-input rows) and compile inside the timing (seen on the CPU;
    the likely cause of MTP rows at 214-377 ms per step on the H100). Up to `repeats` extra
    passes replace the ones that compiled; when every pass compiled, the last is returned with
    a note saying so."""
    passes, compiled = [], []
    for _ in range(2 * repeats):
        p = run_pass()
        (compiled if p["compiled"] else passes).append(p)
        # one line per pass: a row cut off by a timeout still shows how far it got
        log(f"  pass {len(passes) + len(compiled)}: {p['ms_per_step']:.2f} ms/step, "
            f"{p['compiled']} programs compiled")
        if len(passes) == repeats:
            break
    if not passes:
        return dict(compiled[-1], note=f"every timed pass compiled ({len(compiled)} passes): "
                                       "the time includes compiles")
    best = sorted(passes, key=lambda p: p["ms_per_step"])[len(passes) // 2]     # median pass
    best["runs_ms_per_step"] = [p["ms_per_step"] for p in passes]
    best["passes_that_compiled"] = len(compiled)
    return best


def time_startup(params, cfg, spec, args, batch: int, warmup=True) -> dict:
    """Seconds from LLM(..., warmup=warmup) to the first token of one prompt. With
    warmup="background" also the seconds until every bucket is compiled (all_buckets_s, from
    the same start; waited for at most --child-timeout)."""
    import mtpjax
    no_engine_dp_attention(args)
    _listen()
    prompt = prompts_for(cfg, 1, args.prompt_len, seed=99)[0]
    before = collections.Counter(_EVENTS)
    t0 = time.perf_counter()
    llm = mtpjax.LLM(params, cfg, spec, warmup=warmup, mesh=mesh_of(args),
                     fuse_projections=args.fuse_projections,
                     **engine_kwargs(args, batch))
    t1 = time.perf_counter()
    llm.generate([prompt], mtpjax.SamplingParams(max_tokens=1))
    t2 = time.perf_counter()
    extra = {}
    if warmup == "background" and args.first_token_only:
        extra = dict(buckets_at_first_token=len(llm.warmup_times), all_buckets_done=False)
    elif warmup == "background":
        # the first token's figures now: the parent keeps the last result line it saw, also from
        # a process it had to kill while the rest still compiled
        print("E2E_RESULT " + json.dumps(dict(warmup=str(warmup), startup_s=t2 - t0,
                                              construct_s=t1 - t0,
                                              buckets_at_first_token=len(llm.warmup_times),
                                              all_buckets_done=False)), flush=True)
        # wait for the rest within the parent's limit on this process (it kills it at the limit)
        left = args.child_timeout - (time.perf_counter() - _PROCESS_START) - 15
        extra = dict(buckets_at_first_token=len(llm.warmup_times),
                     all_buckets_done=llm.wait_for_warmup(max(left, 1.0)),
                     all_buckets_s=time.perf_counter() - t0)
    ev = _EVENTS - before
    store = llm.runner.store
    return dict(store_loaded=store.hits if store else 0, store_compiled=store.misses if store else 0,
                store_load_s=llm.runner.load_seconds, warmup=str(warmup), **extra,
                startup_s=t2 - t0, construct_s=t1 - t0, first_token_after_construct_s=t2 - t1,
                buckets=len(llm.warmup_times),
                bucket_compile_s={f"{T},{F}": s for T, F, s in llm.warmup_times},
                programs=ev[BACKEND_COMPILE], cache_hits=ev[CACHE_HIT],
                compiled=ev[BACKEND_COMPILE] - ev[CACHE_HIT])


def time_hf(cfg, batch: int, args) -> dict:
    """transformers LlamaForCausalLM, static cache + torch.compile, on CUDA."""
    try:
        import torch
    except ImportError:
        return dict(skipped="no torch")
    if not torch.cuda.is_available():
        return dict(skipped="no CUDA device for torch")
    try:
        import transformers
    except ImportError:
        return dict(skipped="no transformers")
    N = args.new_tokens
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=max(cfg.max_position_embeddings, args.prompt_len + N),
        tie_word_embeddings=False, initializer_range=0.02, pad_token_id=0)
    torch.manual_seed(args.seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = transformers.LlamaForCausalLM(hf_cfg).eval()
    finally:
        torch.set_default_dtype(default)
    note = "static cache, generate's torch.compile"
    if not hasattr(model, "_valid_auto_compile_criteria"):       # older transformers
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        note = "static cache, torch.compile(forward, reduce-overhead)"
    ids = torch.tensor(prompts_for(cfg, batch, args.prompt_len, args.seed), device="cuda")

    class Stamp(transformers.StoppingCriteria):
        def __init__(self):
            self.events = []

        def __call__(self, input_ids, scores, **kwargs):
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.events.append(e)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def once():
        stamp = Stamp()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=N, min_new_tokens=N, do_sample=False,
                             cache_implementation="static", pad_token_id=0,
                             stopping_criteria=transformers.StoppingCriteriaList([stamp]))
        torch.cuda.synchronize()
        steps = len(stamp.events) - 1
        assert out.shape[1] == args.prompt_len + N, out.shape
        return stamp.events[0].elapsed_time(stamp.events[-1]) / 1e3, steps

    once()                                           # compiles
    if note.startswith("static cache, generate") and not hasattr(model, "_compiled_call"):
        note = "static cache, NOT compiled (generate did not auto-compile)"
    runs = [once() for _ in range(args.repeats)]
    dt, steps = sorted(runs)[len(runs) // 2]
    del model
    torch.cuda.empty_cache()
    return dict(ms_per_step=_div(1e3 * dt, steps), tok_per_s=_div(batch * steps, dt), acc_len=1.0,
                steps=steps, note=note, runs_s=[r[0] for r in runs],
                versions=f"torch {torch.__version__}, transformers {transformers.__version__}")


def run_child(args, role: str, batch: int, env_extra: dict | None = None,
              extra_args: tuple = ()) -> dict:
    """This benchmark's `role` ("startup" or "hf") for one batch size in a fresh Python process
    (`extra_args` appended to its command line); returns the dict it prints on its
    `E2E_RESULT` line (a crash or a hang there is an error row here, not the end of the run)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, **(env_extra or {}))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    cmd = [sys.executable, "-m", "mtpjax.bench.e2e", "--child", role, "--model-shape",
           args.model_shape, "--batch", str(batch), "--prompt-len", str(args.prompt_len),
           "--new-tokens", str(args.new_tokens), "--k", str(args.k), "--accept-rate",
           str(args.accept_rate), "--seed", str(args.seed), "--repeats", str(args.repeats),
           "--tensor-parallel", str(args.tensor_parallel),
           "--data-parallel", str(args.data_parallel)]
    if args.max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.fuse_projections:
        cmd += ["--fuse-projections", args.fuse_projections]
    if args.fp8:
        cmd += ["--fp8", args.fp8]
    if args.min_token_bucket is not None:
        cmd += ["--min-token-bucket", str(args.min_token_bucket)]
    if args.first_token_only:
        cmd += ["--first-token-only"]
    cmd += list(extra_args)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=args.child_timeout)
        _keep_child_log(args, role, proc.stderr)
    except subprocess.TimeoutExpired as e:          # what it had done (warm-up progress lines)
        out = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
        _keep_child_log(args, role, out)
        res = _last_result(e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes)
                           else e.stdout or "")
        if res is not None:                         # it got as far as a result line
            res["process_s"] = time.perf_counter() - t0
            res["killed_at_timeout"] = True
            return res
        raise RuntimeError(f"{role} process still running after {args.child_timeout:g} s; its "
                           f"stderr ended:\n{(out or '')[-3000:]}") from None
    res = _last_result(proc.stdout)
    if res is not None:
        res["process_s"] = time.perf_counter() - t0
        return res
    tail = (proc.stdout + proc.stderr)[-2000:]
    raise RuntimeError(f"{role} process exited {proc.returncode} without a result:\n{tail}")


def _keep_child_log(args, role: str, stderr: str | None) -> None:
    """With --out, a child's stderr (warm-up progress, compile logs) goes to
    <out>/child_<role>_<n>.log, n counting this run's children."""
    if not args.out or not stderr:
        return
    os.makedirs(args.out, exist_ok=True)
    n = len([f for f in os.listdir(args.out) if f.startswith(f"child_{role}_")])
    with open(os.path.join(args.out, f"child_{role}_{n}.log"), "w") as f:
        f.write(stderr)


def _last_result(stdout: str) -> dict | None:
    """The last `E2E_RESULT` line a child printed (a background start prints one at its first
    token and a fuller one once every bucket is compiled), or None."""
    found = None
    for line in stdout.splitlines():
        if line.startswith("E2E_RESULT "):
            found = json.loads(line[len("E2E_RESULT "):])
    return found


# ---- table --------------------------------------------------------------------------------------

def _div(a, b) -> float:
    return a / b if b > 0 else float("nan")


def _fmt(x, digits=3):
    if x is None:
        return ""
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        return f"{x:.{digits}g}" if abs(x) < 100 else f"{x:.0f}"
    return str(x)


def table(rows: list[dict]) -> str:
    head = ["row", "batch", "ms/step", "tok/s", "acc len", "floor ms", "% floor", "start-up s",
            "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        note = r.get("skipped") or r.get("error") or r.get("note", "")
        lines.append("| " + " | ".join([
            r["row"], _fmt(r.get("batch")), _fmt(r.get("ms_per_step")), _fmt(r.get("tok_per_s")),
            _fmt(r.get("acc_len")), _fmt(r.get("floor_ms")), _fmt(r.get("pct_floor")),
            _fmt(r.get("startup_s")), str(note).replace("|", "/").replace("\n", " ")[:160]])
            + " |")
    return "\n".join(lines)


# ---- main ---------------------------------------------------------------------------------------

def parse_args(argv):
    ap = argparse.ArgumentParser(prog="mtpjax bench e2e",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--model-shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--batch", default="1,32", help="comma-separated batch sizes")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3, help="drafts per step of the MTP rows")
    ap.add_argument("--accept-rate", type=float, default=0.8,
                    help="synthetic acceptance probability per draft (MTP rows)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per row (median)")
    ap.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                    help="also run the MTP rows with drafts from N of the V token ids "
                         "(SpecConfig.draft_vocab_size; the draft passes read N lm_head columns)")
    ap.add_argument("--replicas", type=int, default=1,
                    help="engine rows: that many independent engines (mtpjax.DataParallelLLM, "
                         "each on --tensor-parallel devices), the batch split between them")
    ap.add_argument("--fuse-projections", nargs="?", const="all", default=False,
                    choices=sorted(FUSION_MODES),
                    help="generate and engine rows with q/k/v and gate/up fused at load "
                         "(model/fused.py; one device); 'qkv': only q/k/v")
    ap.add_argument("--verify-k", type=int, default=None, metavar="N",
                    help="engine MTP rows: each request verifies at most N of the engine's K "
                         "drafts (SamplingParams.num_speculative_tokens), e.g. a K=3 engine "
                         "held at one draft beside a K=1 engine")
    ap.add_argument("--adaptive-k", action="store_true",
                    help="engine MTP rows choose each request's k per step (AdaptiveK(): tokens "
                         "per byte on MoE shapes; the floor averages the bytes of the passes "
                         "its steps ran); compare with fixed --k 0..3 runs")
    ap.add_argument("--fp8", nargs="?", const="block", default=None, choices=["block", "channel"],
                    help="projection weights quantized to FP8 (quantize_fp8: 128x128 block scales, "
                         "or per output channel); the floor counts their FP8 bytes")
    ap.add_argument("--steps-per-check", type=int, default=4,
                    help="generate rows: steps between two 'all done' checks of the device loop")
    ap.add_argument("--rows", default=",".join(ROWS),
                    help=f"comma-separated subset of: {', '.join(ROWS)}")
    ap.add_argument("--no-startup", action="store_true", help="skip the start-up rows")
    ap.add_argument("--warm-start", nargs="?", type=int, const=1, default=0, metavar="N",
                    help="also time start-up in N (default 1) more processes, one after the "
                         "other, with the cache filled (the first after a background start "
                         "also fills the executable store)")
    ap.add_argument("--background-startup", action="store_true",
                    help="also time start-up with LLM(warmup='background') in a fresh process "
                         "with an empty cache: first token, and all buckets compiled")
    ap.add_argument("--first-token-only", action="store_true",
                    help="background start-up rows stop at the first token (do not wait for "
                         "every bucket)")
    ap.add_argument("--no-blocking-startup", action="store_true",
                    help="skip the in-process blocking cold start (then --background-startup "
                         "with --cache-dir fills the cache that --warm-start reads)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=0,
                    help="engine token budget (default: the largest of batch x (K+1), "
                         "min(batch x prompt, 2048) and the prompt, rounded up to a power of "
                         "two)")
    ap.add_argument("--min-token-bucket", type=int, default=None,
                    help="the engine's smallest step shape (LLM min_token_bucket; default: the "
                         "engine's, 1 for MoE models and 8 for dense ones)")
    ap.add_argument("--copy-mib", type=int, default=1024, help="size of the bandwidth copy")
    ap.add_argument("--cache-dir", default=None,
                    help="persistent compilation cache folder (default: a fresh temporary one, "
                         "removed at the end)")
    ap.add_argument("--child-timeout", type=float, default=420,
                    help="seconds for the warm-start and each HF process")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tensor-parallel", type=int, default=1,
                    help="devices on the mesh's 'model' axis (heads, MLP columns, experts, vocab)")
    ap.add_argument("--data-parallel", type=int, default=1,
                    help="devices on the mesh's 'data' axis (replicas)")
    ap.add_argument("--dp-attention", type=int, default=0, metavar="N",
                    help="generate rows in the DP-attention layout on N devices (MLA + MoE "
                         "shapes; batch divisible by N; engine and start-up rows not built)")
    ap.add_argument("--out", default=None, help="folder for e2e.json")
    ap.add_argument("--child", choices=["startup", "hf"], help=argparse.SUPPRESS)
    ap.add_argument("--startup-warmup", choices=["blocking", "background"], default="blocking",
                    help=argparse.SUPPRESS)              # the startup child's LLM(warmup=)
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in args.batch.split(",") if b.strip()]
    args.row_set = {r.strip() for r in args.rows.split(",") if r.strip()}
    unknown = args.row_set - set(ROWS)
    if unknown:
        ap.error(f"unknown rows {sorted(unknown)}; choose from {ROWS}")
    for name in ("tensor_parallel", "data_parallel", "replicas"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.verify_k is not None and not 0 <= args.verify_k <= args.k:
        ap.error(f"--verify-k must be in 0..--k ({args.k}), got {args.verify_k}")
    if args.adaptive_k and args.replicas > 1:
        ap.error(f"--adaptive-k runs one engine; got --replicas {args.replicas}")
    if args.dp_attention < 0 or args.dp_attention and (
            args.tensor_parallel > 1 or args.data_parallel > 1 or args.replicas > 1):
        ap.error(f"--dp-attention N (N >= 1) is its own (N, 1) mesh: got --dp-attention "
                 f"{args.dp_attention} with --tensor-parallel {args.tensor_parallel}, "
                 f"--data-parallel {args.data_parallel}, --replicas {args.replicas}")
    return args


def _init_params(cfg, seed):
    import jax
    import jax.numpy as jnp
    import mtpjax
    params = mtpjax.init_params(cfg, jax.random.PRNGKey(seed), jnp.bfloat16, std=0.02)
    return jax.block_until_ready(params)


def _placed_params(cfg, args):
    """Random params, in their table shardings when a mesh is asked for."""
    params = _init_params(cfg, args.seed)
    if args.fp8:
        import jax
        from mtpjax.model.quantize import quantize_fp8
        params = jax.block_until_ready(quantize_fp8(params, fp8_block(args)))
    mesh = mesh_of(args)
    if mesh is not None and args.dp_attention:      # the layout's placement (experts split)
        import jax
        from mtpjax.parallel.dp_attention import param_shardings_like
        from mtpjax.parallel.placement import place
        params = jax_ready(jax.tree.map(place, params, param_shardings_like(params, cfg, mesh)))
    elif mesh is not None:
        from mtpjax.parallel import shard_params
        params = jax_ready(shard_params(params, cfg, mesh))
    return params


def fp8_block(args):
    """--fp8's quantize_fp8 block: (128, 128) blocks or "channel"; None without --fp8."""
    return None if not args.fp8 else ("channel" if args.fp8 == "channel" else (128, 128))


def jax_ready(x):
    import jax
    return jax.block_until_ready(x)


def child(args) -> int:
    """`--child startup|hf`: one measurement, printed as one JSON line for the parent."""
    cfg = model_config(args.model_shape)
    if args.child == "hf":
        res = time_hf(cfg, args.batches[0], args)
    else:
        from mtpjax.compilation_cache import enable_compilation_cache
        enable_compilation_cache()
        params = _placed_params(cfg, args)
        res = time_startup(params, cfg, spec_config(args), args, args.batches[0],
                           warmup="background" if args.startup_warmup == "background" else True)
    print("E2E_RESULT " + json.dumps(res, default=str), flush=True)
    # no interpreter teardown: freeing tens of GB of device arrays, or daemon warm-up threads
    # still inside a compile, could outlast the parent's limit and lose the result
    sys.stderr.flush()
    os._exit(0)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # before the backend starts
    if args.model_shape == "deepseek-v3-slice":
        # 99.5 GB of weights: JAX's default pool (75% of an H200's 141 GB) does not hold them
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    if args.child:
        return child(args)
    import jax
    from mtpjax.compilation_cache import enable_compilation_cache, is_opted_out
    _listen()
    fresh = None
    if args.cache_dir is None and not is_opted_out() and not jax.config.jax_compilation_cache_dir:
        fresh = tempfile.mkdtemp(prefix="mtpjax_e2e_jax_cache_")
    cache_dir = enable_compilation_cache(args.cache_dir or fresh)
    cache_files = len(os.listdir(cache_dir)) if cache_dir and os.path.isdir(cache_dir) else 0
    try:
        return _run(args, cache_dir, cache_files, fresh)
    finally:
        if fresh:
            shutil.rmtree(fresh, ignore_errors=True)
            shutil.rmtree(fresh + "_executables", ignore_errors=True)   # the executable store


def _run(args, cache_dir, cache_files, fresh) -> int:
    import jax
    cfg = model_config(args.model_shape)
    K = args.k
    dev = jax.devices()[0]
    log(f"device {dev.device_kind} ({jax.default_backend()}), JAX {jax.__version__}; shape "
        f"{args.model_shape}; batches {args.batches}; prompt {args.prompt_len}, new tokens "
        f"{args.new_tokens}, K={K}, synthetic acceptance {args.accept_rate}; mesh "
        f"data={args.data_parallel} x model={args.tensor_parallel} of {len(jax.devices())} devices"
        + (f"; DP attention on {args.dp_attention}" if args.dp_attention else ""))
    log(f"compilation cache: {cache_dir or 'off'}"
        + (f" ({'fresh' if fresh else 'given'}, {cache_files} entries at start)"
           if cache_dir else ""))
    bw = copy_bandwidth(args.copy_mib)
    log(f"copy bandwidth {bw / 1e12:.3f} TB/s ({args.copy_mib} MiB jitted copy, read + written)")
    t0 = time.perf_counter()
    params = _placed_params(cfg, args)
    tree_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    log(f"random {'FP8 (' + args.fp8 + ') + ' if args.fp8 else ''}bf16 params: {tree_bytes / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s")
    w = weight_bytes(cfg, fp8=fp8_block(args))
    counted = w["target_layers"] + w["final_norm"] + w["lm_head"] + w["mtp_module"] \
        + w["embed_table_not_counted"]
    if cfg.moe is not None:
        counted += w["expert"] * cfg.moe.n_routed_experts * (
            w["target_moe_layers"] + w["mtp_moe_layers"])
    log("weights per step: target layers {:.3f} GB + lm_head {:.3f} GB; MTP module {:.3f} GB "
        "(config count {:.3f} GB incl. embedding vs param tree {:.3f} GB)".format(
            w["target_layers"] / 1e9, w["lm_head"] / 1e9, w["mtp_module"] / 1e9,
            counted / 1e9, tree_bytes / 1e9))
    spec = spec_config(args)
    ctx = args.prompt_len + args.new_tokens / 2
    rows: list[dict] = []
    result = dict(device=dev.device_kind, backend=jax.default_backend(), jax=jax.__version__,
                  args={k: v for k, v in vars(args).items() if k != "row_set"},
                  mesh=dict(data=args.data_parallel, model=args.tensor_parallel),
                  copy_bandwidth_Bps=bw, weight_bytes=w, param_tree_bytes=tree_bytes,
                  mean_decode_context=ctx, compilation_cache=cache_dir, rows=rows)

    def save():                                  # after every row: a crash keeps what was done
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "e2e.json"), "w") as f:
                json.dump(result, f, indent=1, default=str)

    def add(row: dict, batch=None, drafts=0, draft_vocab=0):
        if batch is not None and "ms_per_step" in row:
            b = (mixed_step_bytes(w, cfg, batch, ctx, row["passes_used"], draft_vocab)
                 if row.get("passes_used") else step_bytes(w, cfg, batch, ctx, drafts,
                                                          draft_vocab))
            row["bytes_per_step"] = b
            row["floor_ms"] = 1e3 * b["total"] / bw
            row["pct_floor"] = 100 * row["floor_ms"] / row["ms_per_step"]
        rows.append(row)
        save()
        shown = {k: v for k, v in row.items() if k in ("ms_per_step", "tok_per_s", "acc_len",
                                                     "pct_floor", "startup_s", "skipped",
                                                     "error")}
        log(f"{row['row']} (batch {row.get('batch')}): " + ", ".join(
            f"{k} {_fmt(v) if not isinstance(v, str) else v}" for k, v in shown.items()))

    def attempt(name: str, batch, fn, drafts=0, draft_vocab=0):
        log(f"{name}, batch {batch} ...")
        try:
            res = fn()
        except Exception as e:                                 # report, keep going
            traceback.print_exc()
            res = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        add(dict(row=name, batch=batch, **res), batch, drafts, draft_vocab)

    top = max(args.batches)
    if not args.no_startup:
        if not args.no_blocking_startup:
            attempt(f"start-up cold (engine MTP K={K})", top,
                    lambda: _startup_row(params, cfg, spec, args, top, cache_dir, fresh))
        if args.background_startup:
            attempt(f"start-up background (engine MTP K={K})", top,
                    lambda: _background_row(args, top))
        # after a background start only, the warm processes start in the background too
        warm_bg = args.background_startup and args.no_blocking_startup
        for n in range(args.warm_start):
            attempt(f"start-up warm{' background' if warm_bg else ''} (process {n + 2})", top,
                    lambda: _warm_row(args, top, cache_dir, warm_bg))
    reps = f" x{args.replicas} replicas" if args.replicas > 1 else ""
    names = {"generate plain": "generate plain", "generate MTP": f"generate MTP K={K}",
             "engine plain": f"engine plain{reps}", "engine MTP": f"engine MTP K={K}{reps}"}
    N = args.draft_vocab
    spec_dv = dataclasses.replace(spec, draft_vocab_size=N) if N else None
    for batch in args.batches:
        prompts = prompts_for(cfg, batch, args.prompt_len, args.seed)
        for key, name in names.items():
            if key not in args.row_set:
                continue
            mtp = key.endswith("MTP")
            fn = time_generate if key.startswith("generate") else time_engine
            # a replica's step carries its share of the batch: its floor is that batch's
            fb = -(-batch // args.replicas) if key.startswith("engine") else batch
            attempt(name, fb, lambda: fn(params, cfg, spec if mtp else None, prompts, args),
                    K if mtp else 0)
            if mtp and spec_dv is not None:
                attempt(f"{name} draft vocab {N}", batch,
                        lambda: fn(params, cfg, spec_dv, prompts, args), K, N)
    if "HF" in args.row_set:
        for batch in args.batches:
            attempt("HF Llama static+compile", batch, lambda: _hf_row(args, batch))

    if args.out:
        save()
        log(f"wrote {os.path.join(args.out, 'e2e.json')}")
    print(f"\nE2E {args.model_shape} on {dev.device_kind}: prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, K={K}, synthetic acceptance {args.accept_rate}, "
          f"copy {bw / 1e12:.3f} TB/s, floor ctx {ctx:g}"
          + (f", fused projections ({args.fuse_projections})" if args.fuse_projections else ""))
    print(table(rows), flush=True)
    return 0


def _startup_row(params, cfg, spec, args, batch, cache_dir, fresh) -> dict:
    r = time_startup(params, cfg, spec, args, batch)
    where = ("no persistent cache" if not cache_dir else
             "empty fresh cache" if fresh else f"cache {cache_dir}")
    r["note"] = (f"{r['buckets']} step buckets; {r['programs']} programs: {r['compiled']} "
                 f"compiled, {r['cache_hits']} from the cache ({where}), "
                 f"{r.get('store_loaded', 0)} loaded whole from the executable store; LLM() "
                 f"{r['construct_s']:.1f} s")
    return r


def _hf_row(args, batch) -> dict:
    import jax
    if model_config(args.model_shape).model_type != "llama":
        return dict(skipped="the HF peer (LlamaForCausalLM) is timed for llama shapes only")
    if jax.default_backend() == "cpu":
        return dict(skipped="JAX runs on the CPU; the HF peer is timed on CUDA only")
    return run_child(args, "hf", batch)           # torch in its own process: no clash with JAX


def _warm_row(args, batch, cache_dir, background: bool = False) -> dict:
    r = run_child(args, "startup", batch, {"MTPJAX_CACHE_DIR": cache_dir} if cache_dir else None,
                  ("--startup-warmup", "background") if background else ())
    if background:
        return _background_note(r)
    r["note"] = (f"{r['buckets']} step buckets; {r['programs']} programs: {r['compiled']} "
                 f"compiled, {r['cache_hits']} from the cache, {r.get('store_loaded', 0)} loaded "
                 f"whole from the executable store; LLM() {r['construct_s']:.1f} s; "
                 f"whole process {r['process_s']:.1f} s")
    return r


def _background_row(args, batch) -> dict:
    """LLM(warmup="background") in a fresh process with a fresh, empty cache folder, or with
    --cache-dir's (kept, so that a warm start can follow: --no-blocking-startup --warm-start)."""
    folder = args.cache_dir or tempfile.mkdtemp(prefix="mtpjax_e2e_background_")
    try:
        r = run_child(args, "startup", batch, {"MTPJAX_CACHE_DIR": folder},
                      ("--startup-warmup", "background"))
    finally:
        if not args.cache_dir:
            shutil.rmtree(folder, ignore_errors=True)
            shutil.rmtree(folder + "_executables", ignore_errors=True)   # its executable store
    return _background_note(r)


def _background_note(r: dict) -> dict:
    head = (f"first token after {r['startup_s']:.1f} s (LLM() {r['construct_s']:.1f} s, "
            f"{r['buckets_at_first_token']} step buckets compiled)")
    if "all_buckets_s" not in r:            # stopped at its first token, or killed after it
        r["note"] = f"{head}; the rest not waited for"
        return r
    done = "" if r.get("all_buckets_done") else " (not all done: timed out)"
    r["note"] = (f"{head}; every bucket compiled after {r['all_buckets_s']:.1f} s{done} "
                 f"({r['buckets']} buckets); {r['programs']} programs, {r['cache_hits']} from "
                 f"the cache; whole process {r['process_s']:.1f} s")
    return r


if __name__ == "__main__":
    raise SystemExit(main())
