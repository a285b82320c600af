"""`fused_expert_ffn` / `fused_moe_ffn` (a few tokens' routed experts, the whole SwiGLU
FFN in one kernel; interpret mode here, compiled on a GPU with MTPJAX_KERNELS_ON_DEVICE=1)
against a per-pair float64 reference, their errors, their one launch, and the MoE layer and
`generate` on them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul.fused_ffn import (DEFAULT_STAGES, SHARED_STAGES,
                                                     default_blocks, fused_expert_ffn,
                                                     fused_moe_ffn)
from tests.kernel_oracle import interpret_mode
from tests.kernels.test_kernels_expert_tiles import case, reference


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("N,k,G,E,I,blocks", [
    (1, 2, 8, 64, 32, {}),                                          # default blocks
    (1, 3, 8, 64, 64, dict(block_n=16, block_k=16, block_e=32)),    # many steps in both loops
    (1, 4, 4, 128, 64, dict(block_n=32, block_k=64, block_e=128)),  # every expert touched
    (2, 3, 4, 64, 32, {}),                # two tokens, some expert chosen by both
    (4, 3, 8, 64, 32, {}),                # a K=3 verify's four tokens
])
def test_equals_per_pair_reference(seed, N, k, G, E, I, blocks):
    x, ids, wg, wu, wd = case(seed, N, k, G, E, I, none_frac=0.3)
    got = fused_expert_ffn(x, jnp.asarray(ids), wg, wu, wd, interpret=interpret_mode(),
                           **blocks)
    assert got.shape == (N, k, E) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), reference(x, ids, wg, wu, wd), rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_and_gelu(seed):
    x, ids, wg, wu, wd = case(seed, 1, 3, 8, 64, 32, jnp.bfloat16)
    got = fused_expert_ffn(x, jnp.asarray(ids), wg, wu, wd, activation=jax.nn.gelu,
                           interpret=interpret_mode())
    np.testing.assert_allclose(np.asarray(got), reference(x, ids, wg, wu, wd, jax.nn.gelu),
                               rtol=4e-2, atol=4e-2)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("N", [1, 2])
def test_weighted_sum_equals_the_reference(seed, N):
    """fused_moe_ffn: each token's routing-weighted sum of its pairs' outputs, pairs routed
    nowhere adding nothing (they write zero partials: interpret mode fills unwritten outputs
    with NaN, which would leak)."""
    x, ids, wg, wu, wd = case(seed, N, 4, 8, 64, 64, none_frac=0.3)
    w = jax.random.uniform(jax.random.PRNGKey(seed + 10), (N, 4))
    got = fused_moe_ffn(x, jnp.asarray(ids), w, wg, wu, wd, block_n=16,
                        interpret=interpret_mode())
    want = np.einsum("nk,nke->ne", np.asarray(w, np.float64), reference(x, ids, wg, wu, wd))
    assert got.shape == (N, 64) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def shared_case(seed, N, n_shared, E, I, dtype, fused_form):
    """Shared-expert weights of width S = n_shared * I as the kernel's keywords (one [E, 2S]
    gate | up, or gate and up apart), their float64 gate / up / down, and a valid mask with
    the last token padding when N > 1."""
    S = n_shared * I
    ks = jax.random.split(jax.random.PRNGKey(seed + 100), 3)
    gate_up = (0.3 * jax.random.normal(ks[0], (E, 2 * S))).astype(dtype)
    down = (0.3 * jax.random.normal(ks[1], (S, E))).astype(dtype)
    kw = (dict(shared_gate_up=gate_up) if fused_form
          else dict(shared_gate=gate_up[:, :S], shared_up=gate_up[:, S:]))
    f64 = np.asarray(gate_up, np.float64)
    valid = np.arange(N) < max(N - 1, 1)
    return dict(kw, shared_down=down), (f64[:, :S], f64[:, S:], np.asarray(down, np.float64)), \
        valid


def shared_reference(x, gate, up, down, valid, activation=jax.nn.silu):
    x = np.asarray(x, np.float64)
    h = np.asarray(activation(jnp.asarray(x @ gate)), np.float64) * (x @ up)
    return (h @ down) * valid[:, None]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("N,k,n_shared,dtype,fused_form,blocks", [
    (1, 2, 1, jnp.float32, True, {}),                     # one token, V2-Lite's fused layout
    (2, 3, 2, jnp.float32, False, dict(block_n=16)),      # two chunks, gate / up apart, padding
    (4, 3, 2, jnp.float32, True, dict(block_n=16, block_k=16, block_e=32)),  # many steps
    (2, 2, 2, jnp.bfloat16, True, {}),
    (3, 4, 1, jnp.bfloat16, False, dict(block_n=16)),
])
def test_shared_experts_equal_the_reference(seed, N, k, n_shared, dtype, fused_form, blocks):
    """fused_moe_ffn with the shared experts as extra programs: each valid token's routed
    weighted sum plus its shared SwiGLU (every one of the n_shared chunks, all tokens in one
    program); a padding token (its ids routed nowhere, valid False) gets 0, and its x, NaN
    here, reaches nothing, not even the other tokens' rows of the shared dots (NaN x 0 would
    leak). bf16: the kernel rounds the hidden values to bf16 before down, as the XLA form
    does (rtol / atol 4e-2, as the routed bf16 test)."""
    E, I, G = 64, 32, 8
    x, ids, wg, wu, wd = case(seed, N, k, G, E, I, dtype, none_frac=0.3)
    shared, (gate, up, down), valid = shared_case(seed, N, n_shared, E, I, dtype, fused_form)
    ids = np.where(valid[:, None], ids, -1).astype(np.int32)
    x = jnp.where(jnp.asarray(valid)[:, None], x, jnp.nan).astype(dtype)
    w = jax.random.uniform(jax.random.PRNGKey(seed + 10), (N, k))
    got = fused_moe_ffn(x, jnp.asarray(ids), w, wg, wu, wd, **shared, valid=jnp.asarray(valid),
                        interpret=interpret_mode(), **blocks)
    x_real = jnp.where(jnp.asarray(valid)[:, None], x, 0)
    want = (np.einsum("nk,nke->ne", np.asarray(w, np.float64),
                      reference(x_real, ids, wg, wu, wd))
            + shared_reference(x_real, gate, up, down, valid))
    assert got.shape == (N, E) and got.dtype == jnp.float32
    tol = 1e-4 if dtype == jnp.float32 else 4e-2
    np.testing.assert_allclose(np.asarray(got), want, rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.asarray(got)[~valid], 0.0)


@pytest.mark.parametrize("N", [1, 3])
def test_shared_experts_of_padding_alone_are_zero(N):
    """Every token padding (x NaN): the shared programs read nothing and write zeros."""
    x, ids, wg, wu, wd = case(N, N, 2, 8, 64, 32)
    shared, _, _ = shared_case(N, N, 2, 64, 32, jnp.float32, True)
    got = fused_moe_ffn(jnp.full_like(x, jnp.nan), jnp.full((N, 2), -1, jnp.int32),
                        jnp.ones((N, 2)), wg, wu, wd, **shared, valid=jnp.zeros(N, bool),
                        interpret=interpret_mode())
    np.testing.assert_array_equal(np.asarray(got), 0.0)


def test_shared_experts_default_to_every_token_valid():
    """Without valid every token runs its shared chunks, also one routed nowhere."""
    x, ids, wg, wu, wd = case(3, 2, 2, 8, 64, 32)
    ids = np.asarray([[1, 5], [-1, 8]], np.int32)
    shared, (gate, up, down), _ = shared_case(3, 2, 1, 64, 32, jnp.float32, True)
    w = jnp.ones((2, 2))
    got = fused_moe_ffn(x, jnp.asarray(ids), w, wg, wu, wd, **shared, interpret=interpret_mode())
    want = (reference(x, ids, wg, wu, wd).sum(1)
            + shared_reference(x, gate, up, down, np.ones(2, bool)))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def test_shared_experts_are_programs_of_the_one_launch():
    """The shared chunks are programs of the same grid (N x k routed pairs, then S / I shared
    chunks for all N tokens: the shared weights are read once, whatever N; the column blocks
    sized by `default_blocks` for one token's k + S / I pairs), not a second kernel."""
    import re
    x, ids, wg, wu, wd = case(0, 2, 3, 8, 64, 32)
    shared, _, _ = shared_case(0, 2, 2, 64, 32, jnp.float32, True)
    text = str(jax.make_jaxpr(lambda x: fused_moe_ffn(
        x, jnp.asarray(ids), jnp.ones((2, 3)), wg, wu, wd, **shared, interpret=True))(x))
    assert text.count("pallas_call") == 1
    block_n = default_blocks(3 + 2, 64, 32)[0]
    assert re.findall(r"grid=\((\d+), (\d+)\)", text) == [(str(2 * 3 + 2), str(32 // block_n))]
    # their default pipeline depth, and the routed-only kernel's
    assert re.findall(r"num_stages=(\d+)", text) == [str(SHARED_STAGES)]
    routed_only = str(jax.make_jaxpr(lambda x: fused_moe_ffn(
        x, jnp.asarray(ids), jnp.ones((2, 3)), wg, wu, wd, interpret=True))(x))
    assert re.findall(r"num_stages=(\d+)", routed_only) == [str(DEFAULT_STAGES)]


def test_shared_bad_inputs_name_the_value():
    x, ids, wg, wu, wd = case(0, 2, 2, 8, 64, 32)
    ids, w = jnp.asarray(ids), jnp.ones((2, 2))
    shared, _, _ = shared_case(0, 2, 2, 64, 32, jnp.float32, True)
    gate_up, down = shared["shared_gate_up"], shared["shared_down"]

    def call(**kw):
        return fused_moe_ffn(x, ids, w, wg, wu, wd, interpret=True, **kw)

    with pytest.raises(ValueError, match=r"shared_down must be \[S, E=64\] with S a positive "
                                         r"multiple of the expert width I=32, got \(48, 64\)"):
        call(shared_gate_up=gate_up[:, :96], shared_down=down[:48])
    with pytest.raises(ValueError, match=r"shared_gate_up must be \[E=64, 2S=128\] \(gate \| "
                                         r"up\), got \(64, 96\)"):
        call(shared_gate_up=gate_up[:, :96], shared_down=down)
    with pytest.raises(ValueError, match=r"shared_up must be \[E=64, S=64\], got \(64, 32\)"):
        call(shared_gate=gate_up[:, :64], shared_up=gate_up[:, :32], shared_down=down)
    with pytest.raises(ValueError, match="shared_down must be float32 like x and the experts, "
                                         "got bfloat16"):
        call(shared_gate_up=gate_up, shared_down=down.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"shared_gate_up and shared_down, or .*got "
                                         r"\['shared_gate_up'\]"):
        call(shared_gate_up=gate_up)
    with pytest.raises(ValueError, match=r"got \['shared_down', 'shared_gate', "
                                         r"'shared_gate_up'\]"):
        call(shared_gate_up=gate_up, shared_gate=gate_up[:, :64], shared_down=down)
    with pytest.raises(ValueError, match=r"valid must be \[N=2\], got \(3,\)"):
        call(shared_gate_up=gate_up, shared_down=down, valid=jnp.ones(3, bool))


def test_unrouted_token_is_zero():
    x, ids, wg, wu, wd = case(0, 1, 3, 8, 64, 32)
    ids = np.asarray([[-1, 8, 100]], np.int32)                   # every pair routed nowhere
    got = fused_expert_ffn(x, jnp.asarray(ids), wg, wu, wd, interpret=interpret_mode())
    np.testing.assert_array_equal(np.asarray(got), 0.0)


def test_default_blocks_fill_the_gpu():
    """V2-Lite (6 of 64 experts, E 2048, I 1408): 64 columns, 132 programs, 256-row steps;
    the V3 slice (8, E 7168, I 2048): 128 columns, 128 programs, 128-row steps (64 KB of
    gate and up weights per step either way); fewer experts: narrower columns."""
    assert default_blocks(6, 2048, 1408) == (64, 256, 256)
    assert default_blocks(8, 7168, 2048) == (128, 128, 256)
    assert default_blocks(2, 2048, 1408)[0] == 16          # 2 x 22 / 2 x 44: too few
    assert default_blocks(2, 64, 32) == (16, 64, 64)        # blocks capped by the dims
    # V2-Lite's 6 routed experts and its 2 shared ones (S = 2 x 1408) as 8 pairs: 176 programs
    assert default_blocks(6 + 2, 2048, 1408) == (64, 256, 256)
    assert default_blocks(1 + 2, 2048, 1408)[0] == 32       # 3 x 44 = 132 programs


def test_bad_inputs_name_the_value():
    x, ids, wg, wu, wd = case(0, 2, 2, 8, 64, 32)
    with pytest.raises(ValueError, match=r"x must be \[N, E=64\] with 1 <= N <= 8 tokens, "
                                         r"got \(9, 64\)"):
        fused_expert_ffn(jnp.concatenate([x] * 4 + [x[:1]]), jnp.asarray(ids[:1]), wg, wu, wd,
                         interpret=True)
    with pytest.raises(ValueError, match=r"ids must be integers \[N=2, k\], got int32\[1, 2\]"):
        fused_expert_ffn(x, jnp.asarray(ids[:1]), wg, wu, wd, interpret=True)
    with pytest.raises(ValueError, match="ids must be integers"):
        fused_expert_ffn(x[:1], jnp.asarray(ids[:1], jnp.float32), wg, wu, wd,
                         interpret=True)
    with pytest.raises(ValueError, match="block_n=24 must be a power of two"):
        fused_expert_ffn(x[:1], jnp.asarray(ids[:1]), wg, wu, wd, block_n=24,
                         interpret=True)
    with pytest.raises(ValueError, match="block_e=128 .* dividing E=64"):
        fused_expert_ffn(x[:1], jnp.asarray(ids[:1]), wg, wu, wd, block_e=128,
                         interpret=True)
    with pytest.raises(ValueError, match=r"weights must be \[N=1, k=2\] like ids, got \(2,\)"):
        fused_moe_ffn(x[:1], jnp.asarray(ids[:1]), jnp.ones(2), wg, wu, wd, interpret=True)
    with pytest.raises(ValueError, match="must all be bfloat16 or all float32, got x float32, "
                                         "weights float32 / float32 / bfloat16"):
        fused_expert_ffn(x[:1], jnp.asarray(ids[:1]), wg, wu, wd.astype(jnp.bfloat16),
                         interpret=True)


def test_one_launch_and_no_layout_ops():
    """The point of the kernel: one Triton launch for the routed FFN (with the shared experts
    too), and nothing around it but the partials' sum (no gather, sort, scatter, and no
    slice or concatenation of the shared weights: the kernel reads them in place)."""
    from jax import export
    args = (jax.ShapeDtypeStruct((1, 256), jnp.bfloat16), jax.ShapeDtypeStruct((1, 6), jnp.int32),
            jax.ShapeDtypeStruct((16, 256, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((16, 256, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((16, 128, 256), jnp.bfloat16))
    weights = jax.ShapeDtypeStruct((1, 6), jnp.float32)
    shared = (jax.ShapeDtypeStruct((256, 512), jnp.bfloat16),
              jax.ShapeDtypeStruct((256, 256), jnp.bfloat16), jax.ShapeDtypeStruct((1,), bool))
    with_shared = lambda x, i, w, g, u, d, gu, sd, v: fused_moe_ffn(          # noqa: E731
        x, i, w, g, u, d, shared_gate_up=gu, shared_down=sd, valid=v)
    for f, a in ((fused_expert_ffn, args),
                 (fused_moe_ffn, args[:2] + (weights,) + args[2:]),
                 (with_shared, args[:2] + (weights,) + args[2:] + shared)):
        text = export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[
            export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*a).mlir_module()
        assert text.count("__gpu$xla.gpu.triton") == 1
        assert 'name = "fused_expert_ffn' in text
        for op in ("gather", "sort", "scatter", "slice", "concatenate"):
            assert f"stablehlo.{op}" not in text, op


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("N", [1, 2, 4, 5])
def test_moe_layer_takes_the_fused_kernel_up_to_four_tokens(seed, N):
    """The MoE layer (forced onto the Pallas path, interpreted) runs the fused kernel for up
    to four tokens (a K=3 verify at batch 1) and the expert tiles for five, equal to the
    sorted layout's output either way; a padding token (valid False, as `generate`'s second
    row at batch 1) gives 0."""
    from mtpjax.model.grouped_matmul import forced_path
    from mtpjax.model.moe import routed_experts
    x, ids, wg, wu, wd = case(seed, N, 3, 8, 64, 32, none_frac=0.0)
    p = {"w_gate": wg, "w_up": wu, "w_down": wd}
    w = jax.random.uniform(jax.random.PRNGKey(seed), (N, 3))
    for valid in (jnp.ones(N, bool), jnp.arange(N) != N - 1):
        with forced_path("pallas"):
            fused = routed_experts(p, x, jnp.asarray(ids), w, valid, jax.nn.silu)
            text = str(jax.make_jaxpr(lambda x: routed_experts(p, x, jnp.asarray(ids), w, valid,
                                                               jax.nn.silu))(x))
            sorted_ = routed_experts(p, x, jnp.asarray(ids), w, valid, jax.nn.silu,
                                     expert_tiles=False)
        assert ("fused_expert_ffn" in text) == (N <= 4)
        assert ("expert_tiles_gate_up" in text) == (N > 4)
        np.testing.assert_allclose(np.asarray(fused), np.asarray(sorted_), rtol=1e-4,
                                   atol=1e-4)
        np.testing.assert_array_equal(np.asarray(fused)[~np.asarray(valid)], 0.0)


@pytest.mark.parametrize("seed", [0, 1])
def test_fused_token_limit_is_a_setting(monkeypatch, seed):
    """MTPJAX_FUSED_MOE_TOKENS moves the fused kernel's token limit (a K=3 verify's four
    tokens at batch 1): the layer then takes it for four tokens, with the sorted layout's
    output; a value outside 0..8 is refused by name."""
    from mtpjax.model.grouped_matmul import FUSED_TOKENS_ENV, forced_path, fused_moe_tokens
    from mtpjax.model.moe import routed_experts
    N = 4
    x, ids, wg, wu, wd = case(seed, N, 3, 8, 64, 32, none_frac=0.2)
    p = {"w_gate": wg, "w_up": wu, "w_down": wd}
    w = jax.random.uniform(jax.random.PRNGKey(seed), (N, 3))
    valid = jnp.arange(N) < 3
    for limit, fused_expected in (("4", True), ("3", False)):
        monkeypatch.setenv(FUSED_TOKENS_ENV, limit)
        with forced_path("pallas"):
            f = lambda x: routed_experts(p, x, jnp.asarray(ids), w, valid, jax.nn.silu)  # noqa
            text = str(jax.make_jaxpr(f)(x))
            got = f(x)
            want = routed_experts(p, x, jnp.asarray(ids), w, valid, jax.nn.silu,
                                  expert_tiles=False)
        assert ("fused_expert_ffn" in text) == fused_expected
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    for bad in ("9", "-1", "two"):
        monkeypatch.setenv(FUSED_TOKENS_ENV, bad)
        with pytest.raises(ValueError, match=f"{FUSED_TOKENS_ENV}='{bad}': expected an int 0..8"):
            fused_moe_tokens()
    monkeypatch.delenv(FUSED_TOKENS_ENV)
    assert fused_moe_tokens() == 4


def test_generate_at_batch_one_decodes_through_the_fused_kernel(monkeypatch):
    """`generate` runs a batch of one as two rows (a padding row), so its decode steps' MoE
    layers see two tokens: they must take the fused kernel (what made it take two tokens; a
    change to generate's padding would silently lose it). The kernels are replaced by a
    jnp stand-in that records the token counts (interpreting them here adds nothing)."""
    import mtpjax
    import mtpjax.model.moe as moe
    from mtpjax.model.dense_ffn import swiglu
    from mtpjax.model.grouped_matmul import forced_path
    from tests.model.test_deepseek import _ds_params, ds_config

    seen = []

    def stand_in(kind):
        def ffn(x, ids, *rest, **shared):
            seen.append((kind, x.shape[0]))
            weights = rest[0] if kind == "fused" else None
            wg, wu, wd, activation = rest[-4:]
            real = (ids >= 0) & (ids < wg.shape[0])
            e = jnp.where(real, ids, 0)
            h = activation(jnp.einsum("ne,nkei->nki", x, wg[e])) * jnp.einsum(
                "ne,nkei->nki", x, wu[e])
            y = jnp.where(real[..., None], jnp.einsum("nki,nkie->nke", h, wd[e]), 0.0)
            if weights is None:
                return y
            out = jnp.einsum("nk,nke->ne", weights, y)
            if shared:          # the tiny config's shared experts, as the kernel adds them
                sh = swiglu(x, shared["shared_gate"], shared["shared_up"],
                            shared["shared_down"], activation)
                out = out + jnp.where(shared["valid"][:, None], sh, 0.0)
            return out
        return ffn

    monkeypatch.setattr(moe, "fused_moe_ffn", stand_in("fused"))
    monkeypatch.setattr(moe, "expert_tile_swiglu", stand_in("tiles"))
    cfg = ds_config(num_mtp_layers=0)
    with forced_path("pallas"):
        mtpjax.generate(_ds_params(cfg, 0), cfg, [[5, 6, 7, 8, 9]], max_new_tokens=3)
    assert any(kind == "fused" for kind, _ in seen), seen     # the decode steps
    assert all(n <= 2 for kind, n in seen if kind == "fused"), seen


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("fuse", [False, True])
def test_moe_layer_runs_the_shared_experts_in_the_fused_kernel(monkeypatch, seed, fuse):
    """The tiny DeepSeek config's MoE layer (forced onto the Pallas path, interpreted):
    MTPJAX_FUSED_SHARED=1 runs its shared expert in the fused kernel (N x k routed programs
    and one shared one a column block, no XLA SwiGLU beside it), =0 as XLA's SwiGLU after it;
    the real tokens' outputs agree to float32 rounding (both float32 throughout, only the
    summation order differs: rtol / atol 1e-5 at outputs of order 10), with the shared
    weights as loaded (gate, up apart) or fused at load (`shared_gate_up`). A padding token
    gets 0 from the kernel (XLA's form computes the shared experts for it too). Past the
    fused kernel's token limit both settings are XLA's."""
    import re
    from mtpjax.model.fused import fuse_projections
    from mtpjax.model.grouped_matmul import FUSED_SHARED_ENV, forced_path
    from mtpjax.model.moe import MOE
    from tests.model.test_deepseek import _ds_params, ds_config
    cfg = ds_config(num_mtp_layers=0)
    params = _ds_params(cfg, seed)
    p = (fuse_projections(params, cfg) if fuse else params)["layers"][1]     # the MoE layer
    assert ("shared_gate_up" in p) == fuse
    k = cfg.moe.num_experts_per_tok
    for N in (1, 3, 5):
        x = jax.random.normal(jax.random.PRNGKey(seed + N), (N, cfg.hidden_size))
        valid = jnp.arange(N) != N - 1 if N > 1 else jnp.ones(1, bool)
        outs, grids = {}, {}
        for switch in ("1", "0"):
            monkeypatch.setenv(FUSED_SHARED_ENV, switch)
            with forced_path("pallas"):
                text = str(jax.make_jaxpr(lambda x: MOE(p, x, cfg, valid))(x))
                outs[switch] = np.asarray(MOE(p, x, cfg, valid))
            grids[switch] = re.findall(r"grid=\((\d+), \d+\)", text)
        real = np.asarray(valid)
        np.testing.assert_allclose(outs["1"][real], outs["0"][real], rtol=1e-5, atol=1e-5)
        if N <= 4:
            assert grids == {"1": [str(N * k + 1)], "0": [str(N * k)]}, grids
            np.testing.assert_array_equal(outs["1"][~real], 0.0)
        else:
            np.testing.assert_array_equal(outs["1"], outs["0"])
    monkeypatch.setenv(FUSED_SHARED_ENV, "yes")
    with pytest.raises(ValueError, match=f"{FUSED_SHARED_ENV}='yes': expected 0 or 1"):
        MOE(p, x, cfg, valid)


def test_generate_tokens_are_the_same_with_the_shared_experts_fused(monkeypatch):
    """Greedy `generate` on the tiny DeepSeek config, its MoE layers on the (interpreted)
    fused kernel: the tokens do not depend on where the shared experts run."""
    import mtpjax
    from mtpjax.model.grouped_matmul import FUSED_SHARED_ENV, forced_path
    from tests.model.test_deepseek import _ds_params, ds_config
    cfg = ds_config(num_mtp_layers=0)
    params = _ds_params(cfg, 4)
    tokens = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(FUSED_SHARED_ENV, switch)
        with forced_path("pallas"):
            tokens[switch] = mtpjax.generate(params, cfg, [[5, 6, 7, 8, 9], [3, 1, 4]],
                                             max_new_tokens=4).tokens
    assert tokens["1"] == tokens["0"]
