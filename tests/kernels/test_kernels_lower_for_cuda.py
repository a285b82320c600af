"""Every Pallas kernel lowers to Triton for CUDA on this (CPU) machine.

`jax.export(..., platforms=["cuda"])` runs the Pallas -> Triton lowering without a GPU, so a
kernel change that uses an op, a shape or a dtype the Triton backend cannot take fails here, in
CI, instead of in the next GPU session. (Triton's own compile to PTX still happens only on the
GPU: the smoke check `python -m mtpjax.bench.gpu_check` covers that.) Each Triton module is also
run through MLIR's verifier here, which XLA:GPU does when it parses the module: the grouped
matmul once passed lowering and failed only on the H100 ('scf.for' bounds of two int types)."""

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from jax import export

from pallas_kernels.draft_roll import draft_roll
from pallas_kernels.fp8_matmul import fp8_weight_matmul
from pallas_kernels.grouped_matmul import grouped_matmul, grouped_swiglu
from pallas_kernels.mla_paged_attention import mla_paged_attention
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

S = jax.ShapeDtypeStruct
i32, bf16 = jnp.int32, jnp.bfloat16


def lower_for_cuda(fn, *args) -> tuple[str, list]:
    """The exported StableHLO text; every Triton module on the way must pass MLIR's verifier."""
    from jax._src.pallas.triton import pallas_call_registration as registration
    lower = registration.lowering.lower_jaxpr_to_triton_module
    verified = []

    def lower_and_verify(*a, **k):
        result = lower(*a, **k)
        result.module.operation.verify()     # raises with the verifier's message
        verified.append(True)
        return result

    registration.lowering.lower_jaxpr_to_triton_module = lower_and_verify
    try:
        return _export(fn, *args), verified
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower


def _export(fn, *args) -> str:
    exp = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    return exp.mlir_module()


CASES = {
    # decode / verify: B=4 requests, Q=4 query tokens, 8 heads over 2 KV heads, d 128, page 16
    "paged_attention": (paged_attention, (
        S((4, 4, 8, 128), bf16), S((2, 64, 16, 128), bf16), S((2, 64, 16, 128), bf16),
        S((4, 16), i32), S((4,), i32))),
    # ragged: 64 tokens over up to 8 sequences
    "ragged_paged_attention": (ragged_paged_attention, (
        S((64, 8, 128), bf16), S((2, 64, 16, 128), bf16), S((2, 64, 16, 128), bf16),
        S((8, 16), i32), S((8,), i32), S((9,), i32), S((1,), i32))),
    # MLA absorbed form: 16 heads, latent 512 + rope 64, page 64
    "mla_paged_attention": (functools.partial(mla_paged_attention, kv_lora_rank=512), (
        S((32, 16, 576), bf16), S((32, 64, 576), bf16), S((8, 8), i32), S((8,), i32),
        S((9,), i32), S((1,), i32))),
    # its opt-in register savers: value columns split over 2 programs, QK in 128-wide chunks
    "mla_paged_attention_split": (functools.partial(
        mla_paged_attention, kv_lora_rank=512, value_split=2, qk_chunk=128), (
        S((32, 64, 576), bf16), S((32, 64, 576), bf16), S((8, 8), i32), S((8,), i32),
        S((9,), i32), S((1,), i32))),
    # opt-in transposed logits, at the 64-row tile of the H=128 decode
    "mla_paged_attention_keys_first": (functools.partial(
        mla_paged_attention, kv_lora_rank=512, keys_first=True), (
        S((32, 64, 576), bf16), S((32, 64, 576), bf16), S((8, 8), i32), S((8,), i32),
        S((9,), i32), S((1,), i32))),
    "draft_roll": (draft_roll, (
        S((64,), i32), S((64,), i32), S((64, 256), bf16), S((9,), i32), S((8, 4), i32),
        S((8, 4), i32), S((8, 4, 256), bf16), S((8,), i32))),
    "grouped_matmul": (functools.partial(grouped_matmul, num_splits=1), (
        S((256, 256), bf16), S((8, 256, 384), bf16), S((8,), i32))),
    # decode sizes: 6 rows over 64 experts, split-K partials in float32
    "grouped_matmul_split_k": (functools.partial(grouped_matmul, num_splits=4), (
        S((6, 2048), bf16), S((64, 2048, 1408), bf16), S((64,), i32))),
    # the routed experts' SwiGLU: gate + up in one kernel (activation inside), then down
    "grouped_swiglu": (functools.partial(grouped_swiglu, gate_up_blocks=(None, None, 1, None)), (
        S((48, 2048), bf16), S((64, 2048, 1408), bf16), S((64, 2048, 1408), bf16),
        S((64, 1408, 2048), bf16), S((64,), i32))),
    # prefill sizes, the opt-in grid order with column blocks fastest
    "grouped_swiglu_columns_fastest": (functools.partial(grouped_swiglu, columns_fastest=True), (
        S((4096, 2048), bf16), S((64, 2048, 1408), bf16), S((64, 2048, 1408), bf16),
        S((64, 1408, 2048), bf16), S((64,), i32))),
    # decode sizes: gate / up as float32 split-K partials, the activation after their sums
    "grouped_swiglu_split_k": (grouped_swiglu, (
        S((6, 2048), bf16), S((64, 2048, 1408), bf16), S((64, 2048, 1408), bf16),
        S((64, 1408, 2048), bf16), S((64,), i32))),
    # FP8 weight-only projections: DeepSeek's 128 x 128 blocks (one token, split K) and
    # per-output-channel scales (a batch-32 verify's 128 rows), widened to f16 and to bf16
    "fp8_matmul_block": (functools.partial(fp8_weight_matmul, block=(128, 128)), (
        S((1, 4096), bf16), S((4096, 14336), jnp.float8_e4m3fn), S((32, 112), jnp.float32))),
    "fp8_matmul_channel_bf16": (functools.partial(fp8_weight_matmul, block=(14336, 1),
                                                  compute="bfloat16"), (
        S((128, 14336), bf16), S((14336, 4096), jnp.float8_e4m3fn), S((1, 4096), jnp.float32))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_lowers_to_triton_for_cuda(name):
    fn, args = CASES[name]
    text, verified = lower_for_cuda(fn, *args)
    assert "__gpu$xla.gpu.triton" in text, name
    assert verified, f"{name}: no Triton module went through the verifier"



@pytest.mark.parametrize("heads,page,tuning,keys_first", [
    (128, 64, {}, True),                      # 64-row tiles: keys first (the default)
    (16, 64, {}, True),                       # a 16-row decode tile, its block in one page
    (16, 16, {}, False),                      # ... its 32-token block spanning two pages
    (64, 16, {}, True),                       # 64-row tiles keep keys first across pages
    (128, 64, {"value_split": 2}, False),     # value_split (or qk_chunk) turns it off, no error
])
def test_mla_default_picks_the_logits_order_measured_faster(heads, page, tuning, keys_first):
    """keys_first=None (the default) resolves as docs/kernels.md says (from the GPU
    sweeps); the kernel's name carries the choice."""
    fn = functools.partial(mla_paged_attention, kv_lora_rank=512, **tuning)
    text, _ = lower_for_cuda(fn, S((32, heads, 576), bf16), S((32, page, 576), bf16),
                             S((8, 8), i32), S((8,), i32), S((9,), i32), S((1,), i32))
    assert "mla_paged_attn_" in text
    assert ('_kf"' in text) == keys_first, text[text.index("mla_paged_attn_"):][:80]


@pytest.mark.parametrize("heads,page,q_len,tuning", [
    (128, 64, 1, {}),                           # H=128 decode: two 64-row tiles per request
    (16, 16, 4, {}),                            # H=16 verify q4, 64-token blocks of 4 pages
    (16, 64, 1, {"share_logits": False}),       # both warpgroups compute the logits
    (16, 16, 1, {"compact": True, "uniform_q_len": 1}),   # 16-row tiles, reshaped from q
    (128, 64, 4, {"compact": True}),            # compact, gathered (verify q4 H=128)
    (128, 64, 4, {"seesaw": True}),             # FlashMLA's schedule (kernel_seesaw.py)
    (16, 16, 4, {"seesaw": True}),              # ... with 4 page copies a half block
])
def test_mla_mosaic_kernel_lowers_for_cuda_within_shared_memory(heads, page, q_len, tuning):
    """kernel="mosaic" lowers to a Mosaic-GPU call on this machine: wgmma's operand layouts
    and the 227 KiB shared-memory limit are checked while lowering (the shared-logits
    buffers once exceeded it by 1 KiB, with the default cross-warp reduction scratch)."""
    fn = functools.partial(mla_paged_attention, kv_lora_rank=512, kernel="mosaic",
                           block_q=q_len, **tuning)
    text = export.export(jax.jit(fn), platforms=["cuda"])(
        S((8 * q_len, heads, 576), bf16), S((32, page, 576), bf16), S((8, 4096 // page), i32),
        S((8,), i32), S((9,), i32), S((1,), i32)).mlir_module()
    assert "mosaic_gpu" in text
    assert "__gpu$xla.gpu.triton" not in text


@pytest.mark.parametrize("heads,q_len,compact", [(16, 1, True), (128, 4, True),
                                                  (16, 4, None)])
def test_mla_mosaic_uniform_compact_tiles_need_no_gathers(heads, q_len, compact):
    """The point of compact tiles with uniform_q_len (decode / verify steps): the kernel
    reads the queries and writes the outputs token-major, in place, so the program around
    the Mosaic call holds no gather, and no transpose but the KV splits' small f32
    log2-sum-exps (the bf16 query and output transposes cost a tenth of an H=128 verify
    step); the ragged form of the same call gathers. compact None: the
    default, which is compact for uniform batches (what the model's dispatch passes)."""
    def lowered(**kw):
        opts = {} if compact is None else {"compact": compact}
        fn = functools.partial(mla_paged_attention, kv_lora_rank=512, kernel="mosaic",
                               block_q=q_len, **opts, **kw)
        return export.export(jax.jit(fn), platforms=["cuda"])(
            S((8 * q_len, heads, 576), bf16), S((32, 64, 576), bf16), S((8, 64), i32),
            S((8,), i32), S((9,), i32), S((1,), i32)).mlir_module()

    uniform = lowered(uniform_q_len=q_len)
    assert "stablehlo.gather" not in uniform
    transposes = [line for line in uniform.splitlines() if "stablehlo.transpose" in line]
    assert all(re.search(r"-> tensor<[0-9x]+xf32>", t) for t in transposes), transposes
    assert "stablehlo.gather" in lowered()


@pytest.mark.parametrize("G,E,I,stages,persistent", [
    (64, 2048, 1408, None, False),  # DeepSeek-V2-Lite experts, 4096 tokens x 6: 11 gate/up blocks
    (128, 7168, 2048, 3, False),    # the V3 slice; down columns 256 wide
    (64, 2048, 1408, None, True),   # persistent: the output stage beside the ring
])
def test_moe_mosaic_kernel_lowers_for_cuda_within_shared_memory(G, E, I, stages, persistent):
    """grouped_swiglu(kernel="mosaic") at prefill sizes lowers to two Mosaic-GPU calls, no
    Triton: wgmma's layouts and the 227 KiB shared-memory limit are checked while lowering."""
    fn = functools.partial(grouped_swiglu, kernel="mosaic", num_stages=stages,
                           persistent=persistent)
    text = export.export(jax.jit(fn), platforms=["cuda"])(
        S((4096 * 6, E), bf16), S((G, E, I), bf16), S((G, E, I), bf16), S((G, I, E), bf16),
        S((G,), i32)).mlir_module()
    assert text.count("mosaic_gpu") >= 2
    assert "__gpu$xla.gpu.triton" not in text
