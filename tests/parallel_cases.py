"""Subprocess side of tests/parallel/test_parallel.py: runs with 8 (or N) fake CPU devices and prints one
JSON line of results. `python tests/parallel_cases.py CASE [args]`; XLA_FLAGS must be set by the
caller before this starts (jax reads them at import)."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dataclasses  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import mtpjax  # noqa: E402
from mtpjax import SamplingParams, SpecConfig  # noqa: E402

PROMPTS = [[3, 5, 7, 9, 11], [2, 4, 6], [1, 2, 3, 4, 5, 6, 7]]     # 15 tokens: one prefill step
MESHES = [(1, 8), (2, 4), (8, 1)]                                      # (data, model)
# (mesh, api, mode): every mesh runs both APIs, every API every mode, on each model
RUNS = [((1, 8), "generate", "chain"), ((1, 8), "llm", "multi_layer"),
        ((2, 4), "generate", "multi_layer"), ((2, 4), "llm", "plain"),
        ((8, 1), "generate", "plain"), ((8, 1), "llm", "chain")]
NEW = 6


def model(name: str):
    from conftest import random_params, tiny_config
    if name == "gqa":
        # 8 query heads, 4 KV heads: pages split by KV head on model=4, replicated on model=8
        cfg = tiny_config(num_layers=1, num_heads=8, num_kv_heads=4, head_dim=8,
                          num_mtp_layers=2)
        return cfg, random_params(cfg, 0)
    from tests.model.test_deepseek import _ds_params, ds_config
    # one target layer, MLA + MoE (the dense FFN is covered by the GQA model)
    cfg = ds_config(num_heads=8, num_kv_heads=8, num_layers=1, first_k_dense_replace=0)
    return cfg, _ds_params(cfg, 0)


def spec_of(mode: str):
    return None if mode == "plain" else SpecConfig(num_speculative_tokens=2, method=mode)


def run(params, cfg, api, mode, mesh, sampling=None):
    sampling = sampling or SamplingParams(max_tokens=NEW)
    if api == "generate":
        return mtpjax.generate(params, cfg, PROMPTS, max_new_tokens=NEW, spec=spec_of(mode),
                               sampling=sampling, mesh=mesh, page_size=4).tokens, None
    llm = mtpjax.LLM(params, cfg, spec_of(mode), num_pages=40, page_size=4, max_num_seqs=4,
                     max_num_batched_tokens=16, warmup=False, mesh=mesh)
    return [o.token_ids for o in llm.generate(PROMPTS, sampling)], llm


def sharding_report(llm, cfg, mesh) -> dict:
    """Leaves whose sharding is not the table's, and the specs of a few named leaves."""
    from mtpjax.parallel import param_shardings, state_shardings
    bad = []
    for tree, want in ((llm.runner.params, param_shardings(cfg, mesh)),
                       (llm.runner.state, state_shardings(llm.runner.state, cfg, mesh))):
        got_l, _ = jax.tree_util.tree_flatten_with_path(tree)
        want_l = jax.tree.leaves(want)
        assert len(got_l) == len(want_l)
        for (path, a), s in zip(got_l, want_l):
            if not a.sharding.is_equivalent_to(s, a.ndim):
                bad.append(f"{jax.tree_util.keystr(path)}: {a.sharding.spec} != {s.spec}")
    p, st = llm.runner.params, llm.runner.state
    attn = p["layers"][-1]
    named = {"embed": p["embed"], "lm_head": p.get("lm_head", p["embed"]),
             "wq": attn.get("wq", attn.get("wq_b")), "wo": attn["wo"],
             "mtp_eh_proj": p["mtp"][0]["eh_proj"], "draft_probs": st.draft_probs,
             "pages": jax.tree.leaves(st.cache.target[0])[0],
             "mtp_pages": jax.tree.leaves(st.cache.mtp[0])[0]}
    for k in ("wk", "w_gate", "w_down", "router", "shared_gate", "wkv_a", "wkv_b", "wq_a"):
        if k in attn:
            named[k] = attn[k]
    return {"mismatches": bad,
            "specs": {k: [a for a in v.sharding.spec] for k, v in named.items()}}


def case_models(name: str) -> dict:
    """Greedy rows of every run == the single-device plain ref; the sampled row (prompt 1, its
    own seed) == the single-device run of the same mode (plain and chain speculative)."""
    cfg, params = model(name)
    greedy = SamplingParams(max_tokens=NEW)
    mixed = [greedy, SamplingParams(max_tokens=NEW, temperature=1.0, top_k=20, seed=5), greedy]
    out = {"ref": run(params, cfg, "generate", "plain", None, mixed)[0],
           "ref_chain": run(params, cfg, "generate", "chain", None, mixed)[0],
           "runs": [], "shardings": {}}
    for (d, m), api, mode in RUNS:
        mesh = mtpjax.make_mesh(tensor_parallel=m, data_parallel=d)
        sampled = api == "generate" and mode in ("plain", "chain")
        toks, llm = run(params, cfg, api, mode, mesh, mixed if sampled else greedy)
        out["runs"].append({"mesh": [d, m], "api": api, "mode": mode, "tokens": toks,
                            "sampled_row": 1 if sampled else None})
        if llm is not None:
            out["shardings"][f"{d}x{m}"] = sharding_report(llm, cfg, mesh)
    return out


def hlo_model():
    from conftest import random_params, tiny_config
    cfg = tiny_config(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8)
    return cfg, random_params(cfg, 0)


_COLLECTIVE = r"(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("


def case_moe() -> dict:
    """The MoE layer on meshes (expert parallel when the experts divide the model axis):
    its output against one device's (3 seeds, random tokens, padding rows) and the collectives
    of its compiled HLO; and the collectives of the DeepSeek engine step on a (1, 2) mesh that
    come from the MoE layers (op names under "expert_parallel") or from anything routing."""
    import re
    from mtpjax.engine.runner import _step
    from mtpjax.engine.scheduler import SchedulerOutput
    from mtpjax.model.moe import MOE
    from mtpjax.parallel import shard_params
    layer = []
    for seed in range(3):
        cfg, params = model("ds")
        params = _ds_params_seed(cfg, seed)
        p = params["layers"][0]
        x = jax.random.normal(jax.random.PRNGKey(seed + 10), (11, cfg.hidden_size))
        valid = np.arange(11) < 9
        ref = np.asarray(MOE(p, x, cfg, valid))
        for d, m in ((1, 2), (1, 4), (1, 8), (2, 4), (4, 2)):
            mesh = mtpjax.make_mesh(tensor_parallel=m, data_parallel=d)
            ps = shard_params(params, cfg, mesh)["layers"][0]
            f = jax.jit(lambda p, x, v, mesh=mesh: MOE(p, x, cfg, v, mesh))
            out = np.asarray(f(ps, x, valid))
            layer.append({"seed": seed, "mesh": [d, m],
                          "max_err": float(np.max(np.abs(out - ref))),
                          "scale": float(np.max(np.abs(ref))),
                          "collectives": re.findall(_COLLECTIVE,
                                                    f.lower(ps, x, valid).compile().as_text())})
    cfg, params = model("ds")
    llm = mtpjax.LLM(params, cfg, SpecConfig(num_speculative_tokens=2), num_pages=16,
                     page_size=4, max_num_seqs=2, max_num_batched_tokens=8, warmup=False,
                     mesh=mtpjax.make_mesh(tensor_parallel=2))
    r = llm.runner
    empty, _ = r.pack(SchedulerOutput([], [], r.K))
    batch = empty.replace(tokens=np.zeros(8, np.int32), seq_ids=np.zeros(8, np.int32),
                          positions=np.full(8, -1, np.int32))
    inputs, shape = r.device_inputs(batch)
    hlo = _step.lower(r.params, cfg, r.spec, r.state, inputs, first_pass_len=8,
                      backend=r.backend, shape=shape, sampling_mode="greedy").compile().as_text()
    ep, routing = [], []
    for line in hlo.split("\n"):
        m = re.search(r"= (.+?) " + _COLLECTIVE, line)
        if not m:
            continue
        op = re.search(r'op_name="([^"]+)"', line)
        op = op.group(1) if op else ""
        shapes = sorted(set(re.findall(r"[fsu]\d+\[[\d,]*\]", m.group(1))))
        if "expert_parallel" in op:
            ep.append([m.group(2), ",".join(shapes)])
        if "router" in op or "experts" in op.split("/"):
            routing.append([m.group(2), ",".join(shapes), op])
    return {"layer": layer, "step_expert_parallel": sorted(ep), "step_routing": routing,
            "n_layers_with_moe": 1 + cfg.num_mtp_layers}


def case_data_parallel() -> dict:
    """DataParallelLLM on 4 fake devices: outputs against one engine's (greedy rows, and a
    sampled row with an explicit seed), where the requests ran, where each replica's params
    and state live; and the errors for bad arguments."""
    from mtpjax import DataParallelLLM
    cfg, params = model("gqa")
    prompts = [[3, 5, 7, 9, 11], [2, 4, 6], [1, 2, 3, 4, 5, 6, 7], [8, 9], [4, 4, 4, 4]]
    sps = [SamplingParams(max_tokens=NEW, temperature=1.0, top_k=20, seed=7) if i == 1 else
           SamplingParams(max_tokens=NEW) for i in range(len(prompts))]
    # min_token_bucket = the token budget: each engine's steps all run one T = 16 program
    kw = dict(num_pages=40, page_size=4, max_num_seqs=4, max_num_batched_tokens=16,
              min_token_bucket=16, warmup=False)
    out, refs = {}, {}
    # each layout once (the suite's time): plain on (2, 2), chain MTP on (2, 1) and (4, 1)
    for mode, layouts in (("plain", ((2, 2),)), ("chain", ((2, 1), (4, 1)))):
        ref = refs[mode] = [o.token_ids for o in mtpjax.LLM(params, cfg, spec_of(mode),
                                                             **kw).generate(prompts, sps)]
        for dp, tp in layouts:
            llm = DataParallelLLM(params, cfg, spec_of(mode), data_parallel=dp,
                                  tensor_parallel=tp, **kw)
            got = [o.token_ids for o in llm.generate(prompts, sps)]
            devices = [sorted({d.id for x in jax.tree.leaves((r.runner.params, r.runner.state))
                               for d in x.devices()}) for r in llm.replicas]
            out[f"{mode} {dp}x{tp}"] = {"equal": got == ref, "assign": llm.assign(prompts, sps),
                                       "devices": devices}
    # online: add_request / step / abort, on 2 replicas (chain MTP); the one engine's chain
    # tokens of the same prompts and sampling are the layouts' above
    ref = refs["chain"]
    llm = DataParallelLLM(params, cfg, spec_of("chain"), data_parallel=2, **kw)
    seqs = [llm.add_request(p, sp) for p, sp in zip(prompts, sps)]
    placed = sorted({llm._replica_of[id(q)] for q in seqs})
    got = {id(q): [] for q in seqs}
    finished = []
    victim, aborted = llm.add_request([5, 6, 7], SamplingParams(max_tokens=50)), None
    steps = 0
    while llm.has_unfinished_requests():
        for seq, new in llm.step():
            if seq is not victim:
                got[id(seq)] += new
                finished += [seq] if seq.is_finished else []
        steps += 1
        if steps == 2:
            aborted = llm.abort(victim).finish_reason
    out["online"] = {"equal": [got[id(q)] for q in seqs] == ref,
                     "replicas": placed,
                     "finished_once": len(finished) == len(seqs) == len(set(map(id, finished))),
                     "aborted": aborted}
    errors = []
    try:
        llm.get_output(seqs[0])                       # finished and forgotten
    except ValueError as e:
        errors.append(str(e))
    for bad in (dict(data_parallel=3, tensor_parallel=2), dict(data_parallel=0),
                dict(data_parallel=2, mesh=None)):
        try:
            DataParallelLLM(params, cfg, **bad, **kw)
        except ValueError as e:
            errors.append(str(e))
    llm = DataParallelLLM(params, cfg, data_parallel=2, **kw)
    try:
        llm.generate([[1, 2], [10 ** 6]])
    except ValueError as e:
        errors.append(str(e))
    out["idle_after_bad_prompt"] = all(r.scheduler.is_finished() for r in llm.replicas)
    out["errors"] = errors
    # fused projections on size-1 meshes (replicas) and in generate on a non-default device
    greedy = [SamplingParams(max_tokens=NEW)] * len(prompts)
    want = [o.token_ids for o in mtpjax.LLM(params, cfg, **kw).generate(prompts, greedy)]
    fused = DataParallelLLM(params, cfg, data_parallel=2, fuse_projections=True, **kw)
    one = mtpjax.make_mesh(devices=[jax.devices()[3]])
    out["fused_equal"] = (
        [o.token_ids for o in fused.generate(prompts, greedy)] == want
        and mtpjax.generate(params, cfg, prompts, max_new_tokens=NEW, mesh=one, page_size=4,
                            fuse_projections=True).tokens == want)
    # from_pretrained: an Orbax folder read once, two replicas
    import tempfile
    from mtpjax.checkpoint import save
    with tempfile.TemporaryDirectory() as tmp:
        save(os.path.join(tmp, "orbax"), params, cfg)
        llm = DataParallelLLM.from_pretrained(os.path.join(tmp, "orbax"), data_parallel=2, **kw)
        # `want`: the one engine's greedy tokens of the same params and prompts (above)
        out["from_pretrained_equal"] = [o.token_ids for o in llm.generate(prompts, greedy)] == want
    return out


def _ds_params_seed(cfg, seed):
    from tests.model.test_deepseek import _ds_params
    return _ds_params(cfg, seed)


def case_step_hlo() -> dict:
    """The engine's step (chain MTP, K=2) on a (1, 2) mesh at a tiny GQA layout: every collective
    of its compiled HLO per sampling mode as [kind, shape, scope, where] (scope: the named
    scope; where: `loop` inside the draft loop, `cond` in a lax.cond branch (there should be
    none), else `step`)."""
    import re
    from mtpjax.engine.runner import _step
    from mtpjax.engine.scheduler import SchedulerOutput
    cfg, params = hlo_model()
    mesh = mtpjax.make_mesh(tensor_parallel=2)
    llm = mtpjax.LLM(params, cfg, SpecConfig(num_speculative_tokens=2), num_pages=16,
                     page_size=4, max_num_seqs=2, max_num_batched_tokens=8, warmup=False,
                     mesh=mesh)
    r = llm.runner
    empty, _ = r.pack(SchedulerOutput([], [], r.K))
    batch = empty.replace(tokens=np.zeros(8, np.int32), seq_ids=np.zeros(8, np.int32),
                          positions=np.full(8, -1, np.int32))
    inputs, shape = r.device_inputs(batch)
    pat = re.compile(r"= (.+?) (all-gather|all-reduce|reduce-scatter|all-to-all|"
                     r"collective-permute)(?:-start)?\(")
    collectives = {}
    for mode in ("greedy", "filter"):                # the engine's two sampling modes
        compiled = _step.lower(r.params, cfg, r.spec, r.state, inputs, first_pass_len=8,
                               backend=r.backend, shape=shape, sampling_mode=mode).compile()
        found = []
        for line in compiled.as_text().split("\n"):
            m = pat.search(line)
            if not m:
                continue
            op = re.search(r'op_name="([^"]+)"', line)
            op = op.group(1) if op else ""
            scope = op.split("/")[1] if op.count("/") else op
            where = "cond" if "/cond/" in op else ("loop" if "/while/" in op else "step")
            shapes = re.findall(r"[fsu]\d+\[[\d,]*\]", m.group(1))
            found.append([m.group(2), shapes[0] if len(set(shapes)) == 1 else ",".join(shapes),
                          scope, where])
        collectives[mode] = sorted(found)
    return {"collectives": collectives,
            "input_specs": [list(s.spec) for s in jax.tree.leaves(compiled.input_shardings)],
            "output_state_ok": all(
                o.is_equivalent_to(i.sharding, i.ndim) for o, i in zip(
                    jax.tree.leaves(compiled.output_shardings[0]), jax.tree.leaves(r.state)))}


def case_loading(tmp: str) -> dict:
    """load_hf(mesh=) and restore(mesh=) put every leaf in its table sharding, values intact."""
    from mtpjax.checkpoint import export_hf, load_hf, restore, save
    from mtpjax.parallel import param_shardings
    cfg, params = hlo_model()
    mesh = mtpjax.make_mesh(tensor_parallel=2)
    want = param_shardings(cfg, mesh)
    export_hf(os.path.join(tmp, "hf"), params, cfg)
    save(os.path.join(tmp, "orbax"), params, cfg)
    out = {}
    for name, ck in (("hf", load_hf(os.path.join(tmp, "hf"), mesh=mesh)),
                     ("orbax", restore(os.path.join(tmp, "orbax"), mesh=mesh))):
        bad = [jax.tree_util.keystr(p) for (p, a), s in zip(
            jax.tree_util.tree_flatten_with_path(ck.params)[0], jax.tree.leaves(want))
            if not a.sharding.is_equivalent_to(s, a.ndim)]
        same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
            jax.tree.leaves(ck.params), jax.tree.leaves(params)))
        split = sum(1 for a in jax.tree.leaves(ck.params) if not a.sharding.is_fully_replicated)
        out[name] = {"mismatches": bad, "equal": same, "num_split": split}
    llm = mtpjax.LLM.from_pretrained(os.path.join(tmp, "orbax"), mesh=mesh, num_pages=8,
                                     page_size=4, max_num_seqs=2, warmup=False)
    out["from_pretrained"] = [jax.tree_util.keystr(p) for (p, a), s in zip(
        jax.tree_util.tree_flatten_with_path(llm.runner.params)[0], jax.tree.leaves(want))
        if not a.sharding.is_equivalent_to(s, a.ndim)]
    out["from_pretrained_split"] = sum(
        1 for a in jax.tree.leaves(llm.runner.params) if not a.sharding.is_fully_replicated)
    return out


def case_process(process_id: int, port: int) -> dict:
    """One of two processes (4 fake devices each) of one jax.distributed program over
    localhost: a (2, 4) mesh over all 8 devices; generate and the engine, chain MTP, greedy."""
    from mtpjax.parallel import initialize
    initialize(f"localhost:{port}", 2, process_id, cpu_collectives="gloo")
    assert jax.process_count() == 2 and len(jax.devices()) == 8, jax.devices()
    cfg, params = hlo_model()
    mesh = mtpjax.make_mesh(tensor_parallel=4, data_parallel=2)
    spec = SpecConfig(num_speculative_tokens=2)
    gen = mtpjax.generate(params, cfg, PROMPTS, max_new_tokens=NEW, spec=spec, mesh=mesh,
                          page_size=4).tokens
    llm = mtpjax.LLM(params, cfg, spec, num_pages=40, page_size=4, max_num_seqs=4,
                     max_num_batched_tokens=16, warmup=False, mesh=mesh)
    eng = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=NEW))]
    return {"process": jax.process_index(), "generate": gen, "llm": eng}


def case_pallas_per_device() -> dict:
    """The Pallas paged-attention kernels (interpreted) under shard_map on a (1, 2) mesh, heads
    and KV-head pages split: max |kernel - reference| for a uniform (decode/verify) and a ragged
    (prefill) batch, random pages in a random block-table order."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from mtpjax.cache import PagedBatch
    from mtpjax.model.backend import AttentionBackend
    from mtpjax.model.gqa import GQAPages
    from mtpjax.parallel import replicated
    mesh = mtpjax.make_mesh(tensor_parallel=2)
    rng = np.random.default_rng(0)
    KVH, NH, hd, num_pages, S = 2, 4, 64, 6, 8
    k, v = (rng.standard_normal((KVH, num_pages, S, hd)).astype(np.float32) for _ in range(2))
    tables = np.asarray([[3, 1, 0], [5, 2, 4]], np.int32)
    uniform = PagedBatch.uniform(jnp.asarray([[9, 10], [14, 15]], jnp.int32), tables)
    ragged = PagedBatch(positions=jnp.asarray([0, 1, 2, 10, 11, -1], jnp.int32),
                        seq_ids=jnp.asarray([0, 0, 0, 1, 1, 0], jnp.int32),
                        block_tables=jnp.asarray(tables), kv_lens=jnp.asarray([3, 12], jnp.int32),
                        cu_q_lens=jnp.asarray([0, 3, 5], jnp.int32))
    out = {}
    for name, batch in (("uniform", uniform), ("ragged", ragged)):
        q = rng.standard_normal((batch.positions.shape[0], NH, hd)).astype(np.float32)
        ref = AttentionBackend("reference").paged_attention(q, GQAPages(k, v), batch)
        be = AttentionBackend("pallas_interpret", mesh=mesh)
        run = jax.jit(lambda q, k, v, b: be.paged_attention(q, GQAPages(k, v), b))
        got = run(jax.device_put(q, NamedSharding(mesh, P(None, "model"))),
                  jax.device_put(k, NamedSharding(mesh, P("model"))),
                  jax.device_put(v, NamedSharding(mesh, P("model"))),
                  jax.device_put(batch, replicated(mesh)))
        valid = np.asarray(batch.positions) >= 0
        out[name] = float(np.abs(np.asarray(got) - np.asarray(ref))[valid].max())
    return out


def case_train_mesh() -> dict:
    """Three joint train steps on a (1, 2) and a (2, 1) mesh vs one device (same windows):
    the largest parameter difference, and whether every state leaf kept its input sharding."""
    from mtpjax.parallel import make_mesh
    from mtpjax.train import LossConfig, Trainer, adamw
    cfg, params = hlo_model()
    cfg = dataclasses.replace(cfg, num_mtp_layers=2)
    params = mtpjax.init_params(cfg, jax.random.PRNGKey(0))
    windows = np.random.default_rng(0).integers(0, cfg.vocab_size, (4, 12)).astype(np.int32)
    loss = LossConfig(depths=2, regime="both")

    def train(mesh):
        trainer = Trainer(cfg, loss, adamw(1e-2), trainable="all", mesh=mesh)
        state, frozen = trainer.init(params)
        before = jax.tree.map(lambda a: a.sharding, state)
        for _ in range(3):
            state, metrics = trainer.step(state, frozen, windows, 1e-2)
        kept = jax.tree.leaves(jax.tree.map(lambda a, s: a.sharding == s, state, before))
        return trainer.params(state, frozen), all(kept), float(metrics["loss"])

    ref, _, ref_loss = train(None)
    out = {}
    for d, m in ((1, 2), (2, 1)):
        got, kept, got_loss = train(make_mesh(tensor_parallel=m, data_parallel=d))
        diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                   for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))
        moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(params)))
        out[f"{d}x{m}"] = {"max_param_diff": diff, "max_param_change": moved,
                           "shardings_kept": kept, "loss_diff": abs(got_loss - ref_loss)}
    return out


def case_one_process_ref() -> list:
    cfg, params = hlo_model()
    return mtpjax.generate(params, cfg, PROMPTS, max_new_tokens=NEW, page_size=4).tokens


if __name__ == "__main__":
    case = sys.argv[1]
    result = {"models": lambda: case_models(sys.argv[2]),
              "two": lambda: {"hlo": case_step_hlo(), "loading": case_loading(sys.argv[2]),
                              "ref": case_one_process_ref(), "pallas": case_pallas_per_device(),
                              "train": case_train_mesh()},
              "process": lambda: case_process(int(sys.argv[2]), int(sys.argv[3])),
              "moe": case_moe,
              "data_parallel": case_data_parallel,
              }[case]()
    print("RESULT " + json.dumps(result))
