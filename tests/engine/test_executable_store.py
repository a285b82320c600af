"""Executable store (engine/executable_store.py): a second engine loads every warmed-up step
from disk without tracing one, gives the same tokens, and never takes a step that another
configuration, code version or argument layout compiled."""

import json
import os
import pickle
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtpjax
from mtpjax import SamplingParams, SpecConfig
from mtpjax.engine import executable_store
from mtpjax.sampling import SAMPLING_MODES
from tests.conftest import random_params, tiny_config

KW = dict(num_pages=40, page_size=4, max_num_seqs=2, max_num_batched_tokens=8)
# The store's entries come from fresh compiles (XLA:CPU cannot re-serialize a program that
# JAX's persistent cache served), and its tests set JAX's cache folder themselves.
pytestmark = pytest.mark.own_compilation_cache


def _child(folder, seed, **env) -> dict:
    """One engine start in a fresh process (a real warm start; also, XLA:CPU cannot serialize
    a program whose sort it compiled earlier in the same process). `env`: extra environment
    (tests/store_child.py's switches, JAX's persistent cache)."""
    out = subprocess.run([sys.executable, "-m", "tests.store_child", str(folder), str(seed)],
                         capture_output=True, text=True, timeout=600, env={**os.environ, **env},
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _workload(seed):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 46, int(n)).tolist() for n in (1, 7, 13, 3)]
    sps = [SamplingParams(max_tokens=int(m), temperature=t, seed=seed + i)
           for i, (m, t) in enumerate(zip([5, 9, 4, 7], [0, 0.8, 0, 1.0]))]
    return prompts, sps


# One seed: the weights and prompts change no store key. Another seed's first (warm-up) start
# and a second start loading its steps run in test_background_warmup.py's store test.
@pytest.mark.parametrize("seed", [0])
def test_second_process_loads_every_step_without_tracing(tmp_path, seed):
    first = _child(tmp_path, seed)
    programs = first["buckets"] * len(SAMPLING_MODES)
    assert (first["hits"], first["misses"]) == (0, programs)
    assert first["warmup_traces"] == programs
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".jaxexec")]) == programs
    second = _child(tmp_path, seed)
    assert (second["hits"], second["misses"]) == (programs, 0)
    assert second["traces"] == 0, "a warm engine traced its step"
    assert second["tokens"] == first["tokens"]
    # and the tokens are those of an engine without store or warm-up
    cfg = tiny_config(vocab_size=44)
    cold = mtpjax.LLM(random_params(cfg, seed=seed), cfg, SpecConfig(num_speculative_tokens=1),
                      warmup=False, executable_cache=False, **KW)
    assert cold.runner.store is None
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 44, int(n)).tolist() for n in (1, 7, 13, 3)]
    sps = [SamplingParams(max_tokens=int(m), temperature=t, seed=seed + i)
           for i, (m, t) in enumerate(zip([5, 9, 4, 7], [0, 0.8, 0, 1.0]))]
    assert [o.token_ids for o in cold.generate(prompts, sps)] == first["tokens"]


def test_other_configurations_and_damaged_files_are_compiled_not_loaded(tmp_path):
    cfg = tiny_config(vocab_size=46)            # programs no other test of this process compiled
    params = random_params(cfg)
    prompts, sps = _workload(2)
    base = mtpjax.LLM(params, cfg, SpecConfig(num_speculative_tokens=1), warmup=True,
                      executable_cache=tmp_path, **KW)
    base_files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".jaxexec"))
    # another K: new keys, nothing loaded
    other = mtpjax.LLM(params, cfg, SpecConfig(num_speculative_tokens=2), warmup=True,
                       executable_cache=tmp_path, **KW)
    assert other.runner.store.hits == 0 and other.runner.store.misses > 0
    # a damaged file (garbage; then a real entry with one payload byte changed): a warning
    # naming it, compiled again, outputs unchanged
    with open(tmp_path / base_files[0], "wb") as f:
        f.write(b"not an executable")
    with open(tmp_path / base_files[1], "rb") as f:
        entry = pickle.load(f)
    entry["payload"] = entry["payload"][:-1] + bytes([entry["payload"][-1] ^ 1])
    with open(tmp_path / base_files[1], "wb") as f:
        pickle.dump(entry, f)
    # two entries swapped (each file holds another step's program, with the same argument
    # shapes when they are one bucket's sampling modes): refused by the identity they record
    one, two = ((tmp_path / f).read_bytes() for f in base_files[2:4])
    (tmp_path / base_files[2]).write_bytes(two)
    (tmp_path / base_files[3]).write_bytes(one)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = mtpjax.LLM(params, cfg, SpecConfig(num_speculative_tokens=1), warmup=True,
                           executable_cache=tmp_path, **KW)
    said = [str(w.message) for w in caught]
    assert any("could not be loaded" in m for m in said), said
    assert sum("could not be loaded" in m for m in said) == 1, said   # one for all four
    refused = dict(r.split(": ", 1) for r in again.runner.store.refused)
    assert sorted(refused) == sorted(str(tmp_path / f) for f in base_files[:4])
    assert "digest" in refused[str(tmp_path / base_files[1])]
    assert all("another step's program" in refused[str(tmp_path / f)] for f in base_files[2:4])
    # Which program the damaged file holds follows the keys' order, so it changes with every
    # source change. XLA:CPU cannot serialize a program with a sort that this process had
    # compiled before ("`LessThan` is not serializable"): that step then runs unsaved, with
    # a warning. A new process saves it (checked by hand), and only
    # this test compiles a step twice in one process.
    assert all("could not be loaded" in m or "`LessThan` is not serializable" in m
               for m in said), said
    total = base.runner.store.misses + other.runner.store.misses
    assert again.runner.store.hits + again.runner.store.misses == base.runner.store.misses
    assert again.runner.store.misses == 4 < total
    assert [o.token_ids for o in again.generate(prompts, sps)] == \
        [o.token_ids for o in base.generate(prompts, sps)]
    with pytest.raises(ValueError, match="executable_cache must be None, False or a folder"):
        mtpjax.LLM(params, cfg, None, executable_cache=3, **KW)


def test_step_key_covers_code_statics_and_argument_layout(monkeypatch):
    a = (jnp.zeros((4, 8), jnp.float32), {"x": jnp.zeros((3,), jnp.int32)})
    key = executable_store.step_key("s", a, {"cfg": tiny_config(vocab_size=44), "n": 1})
    same = executable_store.step_key("s", a, {"n": 1, "cfg": tiny_config(vocab_size=44)})
    assert key == same
    changed = [
        executable_store.step_key("s", a, {"cfg": tiny_config(vocab_size=45), "n": 1}),
        executable_store.step_key("s", a, {"cfg": tiny_config(vocab_size=44), "n": 2}),
        executable_store.step_key("s", (a[0].astype(jnp.bfloat16), a[1]),
                                  {"cfg": tiny_config(vocab_size=44), "n": 1}),
        executable_store.step_key("s", (a[0], {"y": a[1]["x"]}),
                                  {"cfg": tiny_config(vocab_size=44), "n": 1}),
        executable_store.step_key("t", a, {"cfg": tiny_config(vocab_size=44), "n": 1}),
    ]
    monkeypatch.setattr(executable_store, "_SOURCES", "another version of the code")
    changed.append(executable_store.step_key("s", a, {"cfg": tiny_config(vocab_size=44), "n": 1}))
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/nowhere")
    changed.append(executable_store.step_key("s", a, {"cfg": tiny_config(vocab_size=44), "n": 1}))
    assert len({key, *changed}) == len(changed) + 1


def test_default_store_sits_beside_the_compilation_cache(monkeypatch, tmp_path):
    before = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax_cache"))
        monkeypatch.setenv("MTPJAX_COMPILATION_CACHE", "0")           # the same switch
        assert executable_store.ExecutableStore.default() is None
        monkeypatch.setenv("MTPJAX_COMPILATION_CACHE", "1")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            store = executable_store.ExecutableStore.default()
        assert store.folder == str(tmp_path / "jax_cache_executables")
        assert os.path.isdir(store.folder)
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_step_key_covers_settings_that_change_random_streams():
    """jax_threefry_partitionable changes the bits a seeded step draws: a process with the other
    setting must not load this one's programs (nor any other program-changing setting)."""
    a = (jnp.zeros((4, 8), jnp.float32),)
    before = jax.config.jax_threefry_partitionable
    key = executable_store.step_key("s", a, {"n": 1})
    try:
        jax.config.update("jax_threefry_partitionable", not before)
        flipped = executable_store.step_key("s", a, {"n": 1})
    finally:
        jax.config.update("jax_threefry_partitionable", before)
    assert flipped != key
    assert executable_store.step_key("s", a, {"n": 1}) == key
    # where the caches live is not part of a program
    before_dir = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", "/elsewhere")
        assert executable_store.step_key("s", a, {"n": 1}) == key
    finally:
        jax.config.update("jax_compilation_cache_dir", before_dir)


def test_no_sequence_of_processes_stores_an_entry_that_breaks_a_later_start(tmp_path):
    """XLA:CPU cannot re-serialize a step that JAX's persistent cache served: the copy loads and
    then fails at its first call. Each ordinary way to a store miss with a JAX cache hit —
    the store folder deleted, an edit of the code, a warmup=False run first — must leave every
    later process serving the same tokens, with no warning."""
    def start(folder, cache, **env):
        result = _child(folder, 3, MTPJAX_COMPILATION_CACHE="1",
                        MTPJAX_CACHE_DIR=str(tmp_path / cache), **env)
        assert result["tokens"] == cold["tokens"], (result, cold)
        assert not any("could not be loaded" in w for w in result["warnings"]), result
        return result

    store = tmp_path / "store_a"
    cold = _child(store, 3, MTPJAX_COMPILATION_CACHE="1", MTPJAX_CACHE_DIR=str(tmp_path / "a"))
    programs = cold["buckets"] * len(SAMPLING_MODES)
    assert (cold["hits"], cold["misses"], cold["unstored"]) == (0, programs, 0)
    for f in os.listdir(store):                     # the store folder emptied, JAX's cache kept
        os.remove(store / f)
    start(store, "a")
    start(store, "a")
    start(store, "a", STORE_CHILD_SOURCES="edited")  # an edit of the code: every key misses
    start(store, "a", STORE_CHILD_SOURCES="edited")
    # a warmup=False run first (it fills only JAX's cache), then warm-ups
    start(tmp_path / "store_b", "b", STORE_CHILD_WARMUP="0")
    start(tmp_path / "store_b", "b")
    start(tmp_path / "store_b", "b")


def test_loading_an_entry_first_makes_the_mosaic_kernel_runtime_findable(tmp_path):
    """A fresh process that loads a stored step before tracing anything must have imported
    jax.experimental.mosaic.gpu (it names the Mosaic GPU kernels' runtime library); without
    it a stored step holding Mosaic kernels failed to load on a GPU and was compiled again."""
    code = (
        "import sys, os\n"
        "from mtpjax.engine.executable_store import ExecutableStore\n"
        "name = 'jax.experimental.mosaic.gpu'\n"
        "assert name not in sys.modules, 'imported before any load: the check proves nothing'\n"
        f"store = ExecutableStore({str(tmp_path)!r})\n"
        "assert store.load('k', 'id') is None and name not in sys.modules   # no entry: no import\n"
        "open(store._path('k'), 'wb').write(b'damaged')\n"
        "import warnings; warnings.simplefilter('ignore')\n"
        "assert store.load('k', 'id') is None\n"
        "print('imported' if name in sys.modules else 'not imported')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "imported"
