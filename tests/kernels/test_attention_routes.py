"""Attention routes and the one dispatch (model/attention_routes.py, model/backend.py): each page
kind names its route; every reason the kernels cannot serve a call meets one fallback decision;
model/ never imports parallel/."""

import ast
import pathlib
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtpjax
from mtpjax.cache import PagedBatch
from mtpjax.model import backend as backend_module
from mtpjax.model.attention_routes import (GQA_ROUTE, MLA_ROUTE, MLA_RAGGED_BLOCK_Q,
                                           attention_route)
from mtpjax.model.backend import AttentionBackend
from mtpjax.model.gqa import GQAPages
from mtpjax.model.kinds import ATTENTION_KINDS, attention_kind
from mtpjax.model.mla import LatentPages

REFERENCE = AttentionBackend("reference")
AUTO = AttentionBackend("pallas_interpret", fallback=True)     # what "auto" gives on a GPU
EXPLICIT = AttentionBackend("pallas_interpret")

GQA_CFG = mtpjax.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                             num_heads=4, num_kv_heads=2, head_dim=8)
MLA_CFG = mtpjax.ModelConfig(model_type="deepseek_v3", vocab_size=64, hidden_size=32,
                             intermediate_size=48, num_layers=1, num_heads=4, num_kv_heads=4,
                             attention_kind="mla",
                             mla=dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                                      qk_rope_head_dim=8, v_head_dim=12))
NUM_PAGES, TABLES = 6, np.asarray([[3, 1, 0], [5, 2, 4]], np.int32)


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees the dispatch's warn-once memory empty."""
    monkeypatch.setattr(backend_module, "_warned", set())


def _attend(backend, q, pages, batch, **kw):
    """backend.paged_attention compiled as one program (much faster on CPU than op by op; the
    dispatch still runs, at trace time, once per new shape)."""
    return jax.jit(lambda q, pages, batch: backend.paged_attention(q, pages, batch, **kw))(
        q, pages, batch)


def _batches():
    """A uniform (verify-like, q_len 2) and a ragged (prefill + padding) batch over TABLES."""
    uniform = PagedBatch.uniform(jnp.asarray([[9, 10], [14, 15]], jnp.int32), jnp.asarray(TABLES))
    ragged = PagedBatch(positions=jnp.asarray([0, 1, 2, 10, 11, -1], jnp.int32),
                        seq_ids=jnp.asarray([0, 0, 0, 1, 1, 0], jnp.int32),
                        block_tables=jnp.asarray(TABLES), kv_lens=jnp.asarray([3, 12], jnp.int32),
                        cu_q_lens=jnp.asarray([0, 3, 5], jnp.int32))
    return {"uniform": uniform, "ragged": ragged}


def _gqa(rng, batch, *, kv_heads=2, heads=4, hd=8, page=8):
    k, v = (jnp.asarray(rng.standard_normal((kv_heads, NUM_PAGES, page, hd)), jnp.float32)
            for _ in range(2))
    q = jnp.asarray(rng.standard_normal((batch.positions.shape[0], heads, hd)), jnp.float32)
    return q, GQAPages(k, v)


def _mla(rng, batch, *, rank=16, rope=8, page=8, heads=4):
    latent = jnp.asarray(rng.standard_normal((NUM_PAGES, page, rank + rope)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((batch.positions.shape[0], heads, rank + rope)),
                    jnp.float32)
    return q, LatentPages(latent, rank)


def test_each_page_kind_resolves_to_its_route():
    attention_kind("gqa")                                    # loads the built-in kinds
    want = {"gqa": GQA_ROUTE, "mla": MLA_ROUTE}
    cfgs = {"gqa": GQA_CFG, "mla": MLA_CFG}
    assert set(want) <= set(ATTENTION_KINDS)
    for name, route in want.items():
        kind = ATTENTION_KINDS[name]
        pages = kind.init_pages(cfgs[name], NUM_PAGES, 8, jnp.float32)
        assert type(pages) is kind.pages_type
        assert attention_route(pages) is route and route.pages_type is kind.pages_type
    with pytest.raises(ValueError, match=r"no attention route for pages of type tuple.*GQAPages"):
        attention_route((jnp.zeros(3), jnp.zeros(3)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_route_reads_latent_pages_as_one_shared_head(seed):
    """The MLA reference == GQA's reference over the latent as one KV head whose values are its
    first `rank` entries (so both kinds share one plain-jnp attention)."""
    rng = np.random.default_rng(seed)
    for batch in _batches().values():
        q, pages = _mla(rng, batch)
        shared = GQAPages(pages.latent[None], pages.latent[None, ..., :pages.rank])
        got = _attend(REFERENCE, q, pages, batch, sm_scale=0.3)
        want = _attend(REFERENCE, q, shared, batch, sm_scale=0.3)
        assert got.shape == (q.shape[0], q.shape[1], pages.rank)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# (page kind, shape the kernels do not serve, the words naming it)
UNSUPPORTED = {
    "gqa_head_dim": (_gqa, dict(hd=8), "head_dim 8"),
    "gqa_page_size": (_gqa, dict(hd=64, page=4), "page size 4"),
    "mla_rank": (_mla, dict(rank=12), "MLA kv_lora_rank 12"),
    "mla_rope": (_mla, dict(rope=4), "MLA rope dim 4"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
@pytest.mark.parametrize("seed", [0, 1])
def test_unsupported_shape_with_fallback_warns_once_and_equals_the_reference(case, seed):
    make, shape, words = UNSUPPORTED[case]
    rng = np.random.default_rng(seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in _batches().values():              # two calls, one reason: one warning
            q, pages = make(rng, batch, **shape)
            got = _attend(AUTO, q, pages, batch, sm_scale=0.25)
            want = _attend(REFERENCE, q, pages, batch, sm_scale=0.25)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    texts = [str(w.message) for w in caught]
    assert len(texts) == 1, texts
    assert texts[0].startswith(f"Pallas attention does not support {words}"), texts
    assert texts[0].endswith("; using the reference"), texts


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_shape_with_explicit_pallas_raises_naming_it(case):
    make, shape, words = UNSUPPORTED[case]
    batch = _batches()["uniform"]
    q, pages = make(np.random.default_rng(0), batch, **shape)
    with pytest.raises(ValueError, match=f"the Pallas attention kernels do not support {words}"):
        EXPLICIT.paged_attention(q, pages, batch)


def _fake_mesh(model: int):
    """Enough of a ("data", "model") mesh for the dispatch's decision (no devices needed: the
    layout reason is decided before anything runs)."""
    return types.SimpleNamespace(size=model, shape={"data": 1, "model": model})


def test_mesh_layout_is_one_more_reason_for_the_same_decision():
    """GQA pages with 2 KV heads on a model axis of 4: the mesh layer's layout reason falls back
    under "auto" (== the reference) and names the counts under an explicit "pallas"."""
    batch = _batches()["uniform"]
    q, pages = _gqa(np.random.default_rng(3), batch, kv_heads=2, heads=8, hd=64)
    auto = AttentionBackend("pallas_interpret", fallback=True, mesh=_fake_mesh(4))
    with pytest.warns(UserWarning, match="num_kv_heads=2 is not divisible by its size 4"):
        got = _attend(auto, q, pages, batch)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(_attend(REFERENCE, q, pages, batch)))
    explicit = AttentionBackend("pallas_interpret", mesh=_fake_mesh(4))
    with pytest.raises(ValueError, match="do not support KV heads replicated.*num_kv_heads=2 is "
                                         "not divisible by its size 4"):
        explicit.paged_attention(q, pages, batch)


def _record_kernels(monkeypatch):
    """Replaces the three Pallas kernels with recorders returning zeros of the output shape."""
    import pallas_kernels.mla_paged_attention as mla_pkg
    import pallas_kernels.paged_attention as uniform_pkg
    import pallas_kernels.ragged_paged_attention as ragged_pkg
    calls = []

    def uniform(q, k, v, *a, **kw):
        calls.append(("paged_attention", q.shape, kw))
        return jnp.zeros(q.shape[:-1] + (v.shape[-1],), q.dtype)

    def ragged(q, k, v, *a, **kw):
        calls.append(("ragged_paged_attention", q.shape, kw))
        return jnp.zeros(q.shape[:-1] + (v.shape[-1],), q.dtype)

    def mla(q, latent, *a, kv_lora_rank, **kw):
        calls.append(("mla_paged_attention", latent.shape, kw))
        return jnp.zeros(q.shape[:-1] + (kv_lora_rank,), q.dtype)

    monkeypatch.setattr(uniform_pkg, "paged_attention", uniform)
    monkeypatch.setattr(ragged_pkg, "ragged_paged_attention", ragged)
    monkeypatch.setattr(mla_pkg, "mla_paged_attention", mla)
    return calls


@pytest.mark.parametrize("seed", [0, 1])
def test_supported_shapes_pick_each_kinds_kernels(monkeypatch, seed):
    """GQA: uniform batches -> paged_attention on [rows, q_len] queries, ragged ones ->
    ragged_paged_attention; MLA latent pages -> mla_paged_attention on the latent itself, block_q
    the uniform q_len or MLA_RAGGED_BLOCK_Q."""
    calls = _record_kernels(monkeypatch)
    rng = np.random.default_rng(seed)
    batches = _batches()
    for batch in batches.values():
        q, pages = _gqa(rng, batch, hd=64)
        assert EXPLICIT.paged_attention(q, pages, batch, sm_scale=0.5).shape == q.shape
        q, pages = _mla(rng, batch)
        assert EXPLICIT.paged_attention(q, pages, batch, sm_scale=0.5).shape == (*q.shape[:2], 16)
    names = [c[0] for c in calls]
    assert names == ["paged_attention", "mla_paged_attention",
                     "ragged_paged_attention", "mla_paged_attention"]
    assert calls[0][1] == (2, 2, 4, 64)                      # [rows, q_len, heads, hd]
    assert calls[1][1] == (NUM_PAGES, 8, 24)                 # the latent, not a K/V view
    assert calls[1][2]["block_q"] == 2 and calls[1][2]["uniform_q_len"] == 2
    assert calls[3][2]["block_q"] == MLA_RAGGED_BLOCK_Q and calls[3][2]["uniform_q_len"] is None
    assert all(c[2]["interpret"] and c[2]["sm_scale"] == 0.5 for c in calls)


def _imports(path: pathlib.Path):
    """Every module name an import statement in the file names (module level or inside a
    function), with `from X import Y` also giving X.Y."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module
            yield from (f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.ImportFrom):              # relative: from ..parallel import
            yield from (f"relative:{node.module or a.name}" for a in node.names)


def test_model_never_imports_parallel():
    root = pathlib.Path(mtpjax.__file__).parent
    found = {}
    for path in sorted((root / "model").rglob("*.py")):
        names = {n for n in _imports(path)
                 if n == "mtpjax.parallel" or n.startswith("mtpjax.parallel.")
                 or n.startswith("relative:parallel")}
        if names:
            found[path.name] = sorted(names)
    assert found == {}
    # and the attention dispatch itself does not reach parallel/ at all
    for name in ("backend.py", "attention_routes.py", "attention.py", "gqa.py", "mla.py"):
        assert not any("parallel" in n for n in _imports(root / "model" / name)), name
