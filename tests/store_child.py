"""Child process of tests/engine/test_executable_store.py: one engine start in a fresh process.

    python -m tests.store_child FOLDER SEED  ->  one JSON line: store hits / misses / refused /
                                                unstored, traces of the engine step, warnings,
                                                and the workload's tokens

Environment: STORE_CHILD_WARMUP=0 builds the engine without warm-up (the store is then not
used; JAX's persistent cache still fills as the workload compiles), =background with
warmup="background" (waited for before the counts are read); STORE_CHILD_SOURCES=<text>
stands in for the hash of the package sources (what an edit of the code changes).
"""
import json
import os
import sys
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(folder: str, seed: int) -> None:
    import numpy as np

    import mtpjax
    from mtpjax import SamplingParams, SpecConfig
    from mtpjax.engine import executable_store
    from mtpjax.engine import runner as runner_mod
    from tests.conftest import random_params, tiny_config

    if os.environ.get("STORE_CHILD_SOURCES"):
        executable_store._SOURCES = os.environ["STORE_CHILD_SOURCES"]
    traces = [0]
    inner = runner_mod.mixed_step

    def counting(*a, **k):
        traces[0] += 1
        return inner(*a, **k)
    runner_mod.mixed_step = counting
    cfg = tiny_config(vocab_size=44)
    mode = os.environ.get("STORE_CHILD_WARMUP", "1")
    warmup = "background" if mode == "background" else mode == "1"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = mtpjax.LLM(random_params(cfg, seed=seed), cfg, SpecConfig(num_speculative_tokens=1),
                         warmup=warmup,
                         executable_cache=folder, num_pages=40, page_size=4,
                         max_num_seqs=2, max_num_batched_tokens=8)
        warm_traces = traces[0]
        rng = np.random.default_rng(seed)
        prompts = [rng.integers(0, 44, int(n)).tolist() for n in (1, 7, 13, 3)]
        sps = [SamplingParams(max_tokens=int(m), temperature=t, seed=seed + i)
               for i, (m, t) in enumerate(zip([5, 9, 4, 7], [0, 0.8, 0, 1.0]))]
        tokens = [o.token_ids for o in llm.generate(prompts, sps)]
        assert llm.wait_for_warmup(600)
    store = llm.runner.store
    print(json.dumps(dict(hits=store.hits, misses=store.misses, refused=len(store.refused),
                          unstored=store.unstored, buckets=len(llm.warmup_times),
                          warmup_traces=warm_traces, traces=traces[0], tokens=tokens,
                          warnings=[str(w.message) for w in caught])))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
