"""mtpjax.train: the joint loss against a hand computation, reproducible training and exact
resume, MTP-head fine-tuning on the frozen shipped model, export to transformers and back."""

import functools
import json
import os
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtpjax
from mtpjax.train import (LossConfig, Trainer, adamw, finetune_mtp, joint_loss, reinit_mtp,
                          restore_train_state, save_train_state)
from mtpjax.train.data import list_files, sample_windows
from tests.conftest import tiny_config


# ---- the joint loss, by hand ------------------------------------------------------------------

def _log_softmax(z):
    z = z.astype(jnp.float32)
    m = jnp.max(z, axis=-1, keepdims=True)
    return z - m - jnp.log(jnp.sum(jnp.exp(z - m), axis=-1, keepdims=True))


def _multi_layer_by_hand(params, cfg, h0, x, S):
    """Depth s at position i: module s % D on (previous depth's hidden at i, x_{i+s+1})."""
    T = h0.shape[1]
    hh, out = h0, []
    for s in range(S):
        hh, lg = mtpjax.mtp_forward(params, cfg, s % cfg.num_mtp_layers, hh, x[:, s + 1:s + 1 + T])
        out.append(lg)
    return out


def _chain_root(params, cfg, h0, x, S, i):
    """Root i's draft-loop sequence: positions 0..i carry target inputs (h^0_j, x_{j+1});
    position i+s carries (output of depth s-1 at i+s-1, x_{i+s+1}). Padded to T+S positions
    (causal attention: what follows i+s changes nothing at i+s).
    Returns the logits of depths 0..S-1 of root i, each [B, V]."""
    B, T, E = h0.shape
    pos = jnp.arange(T + S)
    hid = jnp.where((pos <= i)[None, :, None], jnp.pad(h0, ((0, 0), (0, S), (0, 0))), 0.0)
    tok = jnp.where((pos <= i)[None, :], jnp.pad(x[:, 1:T + 1], ((0, 0), (0, S))), 0)
    out = []
    for s in range(S):
        if s:
            hid = jnp.where((pos == i + s)[None, :, None], g[:, None], hid)
            tok = jnp.where((pos == i + s)[None, :], jnp.take(x, i + s + 1, axis=1)[:, None], tok)
        hs, lg = mtpjax.mtp_forward(params, cfg, s % cfg.num_mtp_layers, hid, tok)
        g = jnp.take(hs, i + s, axis=1)
        out.append(jnp.take(lg, i + s, axis=1))
    return out


def _chain_by_hand(params, cfg, h0, x, S):
    per_root = jax.vmap(lambda i: _chain_root(params, cfg, h0, x, S, i))(jnp.arange(h0.shape[1]))
    return [jnp.swapaxes(lg, 0, 1) for lg in per_root]            # [T, B, V] -> [B, T, V]


@functools.partial(jax.jit, static_argnums=(1, 3, 4, 5, 6, 7, 8))
def _loss_by_hand(params, cfg, x, S, regime, labels, mtp_weight, decay, target_weight):
    """L = tw * mean CE(target) + sum_s w_s * mean_regimes mean_i loss_s (docs/training.md)."""
    T = x.shape[1] - S - 1
    z, h = mtpjax.forward(params, cfg, x[:, :T + S], return_hidden=True)
    B = x.shape[0]
    b = jnp.arange(B)[:, None]
    i = jnp.arange(T)[None, :]
    target = -_log_softmax(z)[b, i, x[:, 1:T + 1]].mean()
    regimes = ["multi_layer", "chain"] if regime == "both" else [regime]
    per_depth = [[None] * S for _ in regimes]
    for r, name in enumerate(regimes):
        fn = _multi_layer_by_hand if name == "multi_layer" else _chain_by_hand
        for s, lg in enumerate(fn(params, cfg, h[:, :T], x, S)):
            logq = _log_softmax(lg)
            teacher = z[:, s + 1:s + 1 + T]
            if labels == "data":
                ls = -logq[b, i, x[:, s + 2:s + 2 + T]]
            elif labels == "target_greedy":
                ls = -logq[b, i, jnp.argmax(teacher, -1)]
            else:
                logp = _log_softmax(teacher)
                ls = jnp.sum(jnp.exp(logp) * (logp - logq), -1)
            per_depth[r][s] = ls.mean()
    per_depth = jnp.asarray(per_depth)
    total = target_weight * target + sum(
        mtp_weight * decay ** s * per_depth[:, s].mean() for s in range(S))
    return total, target, per_depth


@pytest.mark.parametrize("regime,labels,D", [("both", "data", 2), ("chain", "target_kl", 1),
                                             ("multi_layer", "target_greedy", 1)])
def test_joint_loss_equals_hand_computation(regime, labels, D):
    """multi_layer and chain, data labels and both self-distillation labels, module reuse
    (D=1, 3 depths: chain feeds the module its own output), on random models and tokens."""
    for seed in (0, 1):
        cfg = tiny_config(num_mtp_layers=D, num_layers=1)
        params = mtpjax.init_params(cfg, jax.random.PRNGKey(seed), std=0.3)
        S, T = 3, 5
        x = jax.random.randint(jax.random.PRNGKey(10 + seed), (2, T + S + 1), 0, cfg.vocab_size)
        lc = LossConfig(depths=S, regime=regime, labels=labels, mtp_weight=0.7, depth_decay=0.6,
                        target_weight=0.0 if labels != "data" else 1.0)
        total, m = jax.jit(joint_loss, static_argnums=(1, 3))(params, cfg, x, lc)
        want_total, want_target, want_depths = _loss_by_hand(
            params, cfg, x, S, regime, labels, 0.7, 0.6, lc.target_weight)
        np.testing.assert_allclose(float(m["target_loss"]), want_target, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(m["mtp_loss"]), want_depths, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(float(total), want_total, rtol=1e-5)


def test_loss_config_rejects_bad_values():
    with pytest.raises(ValueError, match="regime 'eagle'"):
        LossConfig(regime="eagle")
    with pytest.raises(ValueError, match="labels 'soft'"):
        LossConfig(labels="soft")
    with pytest.raises(ValueError, match="depths must be an int >= 1, got 0"):
        LossConfig(depths=0)
    with pytest.raises(ValueError, match="trainable 'target'"):
        Trainer(tiny_config(), LossConfig(), adamw(), trainable="target")
    with pytest.raises(ValueError, match="target_weight must be 0"):
        finetune_mtp({}, tiny_config(), None, rng=None, loss=LossConfig(), steps=1)


# ---- reproducible training, exact resume, export to transformers and back ---------------------

def _run(trainer, params, stream, steps, state=None, frozen=None, rng=None):
    if state is None:
        state, frozen = trainer.init(params)
    rng = rng or np.random.default_rng(5)
    L = trainer.loss.window_length(8)
    for _ in range(steps):
        state, _ = trainer.step(state, frozen, sample_windows(stream, rng, 4, L), 1e-2)
    return state, frozen, rng


def _leaves(tree):
    return [np.asarray(a) for a in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny qwen2 target + 2 MTP modules trained jointly (both regimes) for 4 steps, twice,
    and once as 2 steps + Orbax save / restore + 2 steps."""
    cfg = tiny_config(model_type="qwen2", qkv_bias=True, num_layers=1, num_mtp_layers=2)
    params = mtpjax.init_params(cfg, jax.random.PRNGKey(3))
    stream = np.random.default_rng(0).integers(0, cfg.vocab_size, 2000).astype(np.int32)
    trainer = Trainer(cfg, LossConfig(depths=2, regime="both"), adamw())
    a, fa, _ = _run(trainer, params, stream, 4)
    b, fb, _ = _run(trainer, params, stream, 4)
    half, frozen, rng = _run(trainer, params, stream, 2)
    path = str(tmp_path_factory.mktemp("train") / "ckpt")
    save_train_state(path, half, rng)
    restored, rng2 = restore_train_state(path, trainer.init(params)[0])
    restored_step = int(restored.step)
    c, _, _ = _run(trainer, None, stream, 2, restored, frozen, rng2)
    return dict(cfg=cfg, params=params, trainer=trainer, runs=(a, b, c), frozen=fa,
                restored_step=restored_step)


def test_training_is_reproducible_and_resumes_exactly(trained):
    a, b, c = trained["runs"]
    assert int(a.step) == int(c.step) == 4 and trained["restored_step"] == 2
    for x, y, z in zip(_leaves(a), _leaves(b), _leaves(c)):
        assert x.tobytes() == y.tobytes() == z.tobytes()
    # every leaf was trained (target and both modules), and the caller's params are intact
    for x, y in zip(_leaves(a.params), _leaves(trained["params"])):
        assert not np.array_equal(x, y)


def test_trained_export_loads_in_transformers_and_back(trained, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from mtpjax.checkpoint import export_hf, load_pretrained
    cfg, trainer = trained["cfg"], trained["trainer"]
    params = jax.tree.map(np.asarray, trainer.params(trained["runs"][0], trained["frozen"]))
    export_hf(str(tmp_path / "hf"), params, cfg)
    back = load_pretrained(str(tmp_path / "hf"), jnp.float32)
    assert back.cfg == cfg
    for x, y in zip(_leaves(back.params), _leaves(params)):
        assert x.tobytes() == y.tobytes()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen2ForCausalLM"
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(mtpjax.forward(params, cfg, jnp.asarray(ids))), ref,
                               atol=1e-4, rtol=1e-4)


# ---- fine-tuning the shipped model's head on its frozen target ---------------------------------

def test_finetune_mtp_head_keeps_target_and_raises_heldout_acceptance():
    from mtpjax.assets import tiny_model_path
    from mtpjax.checkpoint import load_pretrained
    path = tiny_model_path()
    ck = load_pretrained(path, jnp.float32)
    cfg = ck.cfg
    with open(os.path.join(path, "prompts.json")) as f:
        heldout = json.load(f)
    prompts = [ck.tokenizer.encode(p["text"]) for p in heldout[:4]]
    # training text: stdlib files the model's prompts were not cut from
    root = sysconfig.get_paths()["stdlib"]
    names = {p["file"] for p in heldout}
    files = [f for f in list_files(root) if os.path.relpath(f, root) not in names][:12]
    stream = np.concatenate([np.asarray(ck.tokenizer.encode(open(f).read()) + [0], np.int32)
                             for f in files])
    spec = mtpjax.SpecConfig(num_speculative_tokens=1, method="chain")

    def acceptance(params):
        return mtpjax.eval_acceptance(params, cfg, spec, prompts, max_new_tokens=24,
                                      temperatures=(0.0,))[0.0]

    start = reinit_mtp(ck.params, cfg, seed=0)            # a fresh head: accepts nothing
    before = acceptance(start)
    loss = LossConfig(depths=1, regime="chain", labels="target_kl", target_weight=0.0)
    tuned, result = finetune_mtp(
        start, cfg, lambda r: sample_windows(stream, r, 4, loss.window_length(32)),
        rng=np.random.default_rng(0), loss=loss, steps=120, lr=1e-2, log_every=1e9,
        progress=False)
    after = acceptance(tuned)
    assert result.steps == 120
    for name in ck.params:
        if name != "mtp":
            for x, y in zip(_leaves(tuned[name]), _leaves(ck.params[name])):
                assert x.tobytes() == y.tobytes(), name
    assert before.acceptance_rate < 0.03 and after.acceptance_rate > 0.12, (before, after)
    for r in (before, after):           # the statistics agree with each other
        assert sum(r.num_accepted_histogram) == r.verify_steps
        assert r.proposed_draft_tokens == r.verify_steps
        assert np.isclose(r.acceptance_rate, r.accepted_draft_tokens / r.proposed_draft_tokens)
        assert np.isclose(sum(r.per_position_acceptance) * r.verify_steps, r.accepted_draft_tokens)
