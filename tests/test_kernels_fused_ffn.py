"""`one_token_expert_ffn` (one token's routed experts, the whole SwiGLU FFN in one kernel;
interpret mode here, compiled on a GPU with MTPJAX_KERNELS_ON_DEVICE=1) against a per-pair
float64 reference, its errors, its one launch, and the MoE layer on it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul.fused_ffn import (default_blocks, one_token_expert_ffn,
                                                     one_token_moe_ffn)
from tests.kernel_oracle import interpret_mode
from tests.test_kernels_expert_tiles import case, reference


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("k,G,E,I,blocks", [
    (2, 8, 64, 32, {}),                                          # default blocks
    (3, 8, 64, 64, dict(block_n=16, block_k=16, block_e=32)),    # many steps in both loops
    (4, 4, 128, 64, dict(block_n=32, block_k=64, block_e=128)),  # every expert touched
])
def test_equals_per_pair_reference(seed, k, G, E, I, blocks):
    x, ids, wg, wu, wd = case(seed, 1, k, G, E, I, none_frac=0.3)
    got = one_token_expert_ffn(x, jnp.asarray(ids), wg, wu, wd, interpret=interpret_mode(),
                               **blocks)
    assert got.shape == (1, k, E) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), reference(x, ids, wg, wu, wd), rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_and_gelu(seed):
    x, ids, wg, wu, wd = case(seed, 1, 3, 8, 64, 32, jnp.bfloat16)
    got = one_token_expert_ffn(x, jnp.asarray(ids), wg, wu, wd, activation=jax.nn.gelu,
                               interpret=interpret_mode())
    np.testing.assert_allclose(np.asarray(got), reference(x, ids, wg, wu, wd, jax.nn.gelu),
                               rtol=4e-2, atol=4e-2)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_weighted_sum_equals_the_reference(seed):
    """one_token_moe_ffn: the routing-weighted sum of the pairs' outputs, pairs routed nowhere
    adding nothing (their partials are never written: NaN there must not leak)."""
    x, ids, wg, wu, wd = case(seed, 1, 4, 8, 64, 64, none_frac=0.3)
    w = jax.random.uniform(jax.random.PRNGKey(seed + 10), (1, 4))
    got = one_token_moe_ffn(x, jnp.asarray(ids), w, wg, wu, wd, block_n=16,
                            interpret=interpret_mode())
    want = np.einsum("nk,nke->ne", np.asarray(w, np.float64), reference(x, ids, wg, wu, wd))
    assert got.shape == (1, 64) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def test_unrouted_token_is_zero():
    x, ids, wg, wu, wd = case(0, 1, 3, 8, 64, 32)
    ids = np.asarray([[-1, 8, 100]], np.int32)                   # every pair routed nowhere
    got = one_token_expert_ffn(x, jnp.asarray(ids), wg, wu, wd, interpret=interpret_mode())
    np.testing.assert_array_equal(np.asarray(got), 0.0)


def test_default_blocks_fill_the_gpu():
    """V2-Lite (6 of 64 experts, E 2048, I 1408): 64 columns, 132 programs, 256-row steps;
    the V3 slice (8, E 7168, I 2048): 128 columns, 128 programs, 128-row steps (64 KB of
    gate and up weights per step either way); fewer experts: narrower columns."""
    assert default_blocks(6, 2048, 1408) == (64, 256, 256)
    assert default_blocks(8, 7168, 2048) == (128, 128, 256)
    assert default_blocks(2, 2048, 1408)[0] == 16          # 2 x 22 / 2 x 44: too few
    assert default_blocks(2, 64, 32) == (16, 64, 64)        # blocks capped by the dims


def test_bad_inputs_name_the_value():
    x, ids, wg, wu, wd = case(0, 2, 2, 8, 64, 32)
    with pytest.raises(ValueError, match=r"x must be \[1, E=64\] \(one token\), got \(2, 64\)"):
        one_token_expert_ffn(x, jnp.asarray(ids[:1]), wg, wu, wd, interpret=True)
    with pytest.raises(ValueError, match="ids must be integers"):
        one_token_expert_ffn(x[:1], jnp.asarray(ids[:1], jnp.float32), wg, wu, wd,
                             interpret=True)
    with pytest.raises(ValueError, match="block_n=24 must be a power of two"):
        one_token_expert_ffn(x[:1], jnp.asarray(ids[:1]), wg, wu, wd, block_n=24,
                             interpret=True)
    with pytest.raises(ValueError, match="block_e=128 .* dividing E=64"):
        one_token_expert_ffn(x[:1], jnp.asarray(ids[:1]), wg, wu, wd, block_e=128,
                             interpret=True)
    with pytest.raises(ValueError, match=r"weights must be \[1, k=2\] like ids, got \(2,\)"):
        one_token_moe_ffn(x[:1], jnp.asarray(ids[:1]), jnp.ones(2), wg, wu, wd, interpret=True)
    with pytest.raises(ValueError, match="must all be bfloat16 or all float32, got x float32, weights float32 / float32 / bfloat16"):
        one_token_expert_ffn(x[:1], jnp.asarray(ids[:1]), wg, wu, wd.astype(jnp.bfloat16),
                             interpret=True)


def test_one_launch_and_no_layout_ops():
    """The point of the kernel: one Triton launch for the routed FFN, and nothing around it
    but the pad, the partials' sum and the mask (no gather, sort or scatter)."""
    from jax import export
    args = (jax.ShapeDtypeStruct((1, 256), jnp.bfloat16), jax.ShapeDtypeStruct((1, 6), jnp.int32),
            jax.ShapeDtypeStruct((16, 256, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((16, 256, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((16, 128, 256), jnp.bfloat16))
    weights = jax.ShapeDtypeStruct((1, 6), jnp.float32)
    for f, a in ((one_token_expert_ffn, args),
                 (one_token_moe_ffn, args[:2] + (weights,) + args[2:])):
        text = export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[
            export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*a).mlir_module()
        assert text.count("__gpu$xla.gpu.triton") == 1
        assert 'name = "one_token_expert_ffn' in text
        for op in ("gather", "sort", "scatter"):
            assert f"stablehlo.{op}" not in text, op


@pytest.mark.parametrize("seed", [0, 1])
def test_moe_layer_at_one_token_takes_the_fused_kernel(seed):
    """The MoE layer at one token (forced onto the Pallas path, interpreted) runs the fused
    kernel, and equals the sorted layout's output; a padding token (valid False) gives 0."""
    from mtpjax.model.grouped_matmul import forced_path
    from mtpjax.model.moe import routed_experts
    x, ids, wg, wu, wd = case(seed, 1, 3, 8, 64, 32, none_frac=0.0)
    p = {"w_gate": wg, "w_up": wu, "w_down": wd}
    w = jax.random.uniform(jax.random.PRNGKey(seed), (1, 3))
    for valid in (jnp.asarray([True]), jnp.asarray([False])):
        with forced_path("pallas"):
            fused = routed_experts(p, x, jnp.asarray(ids), w, valid, jax.nn.silu)
            text = str(jax.make_jaxpr(lambda x: routed_experts(p, x, jnp.asarray(ids), w, valid,
                                                               jax.nn.silu))(x))
            sorted_ = routed_experts(p, x, jnp.asarray(ids), w, valid, jax.nn.silu,
                                     expert_tiles=False)
        assert "one_token_expert_ffn" in text and "expert_tiles_gate_up" not in text
        np.testing.assert_allclose(np.asarray(fused), np.asarray(sorted_), rtol=1e-4,
                                   atol=1e-4)
        if not bool(valid[0]):
            np.testing.assert_array_equal(np.asarray(fused), 0.0)
