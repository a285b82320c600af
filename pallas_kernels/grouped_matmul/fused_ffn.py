"""A token or two's routed experts, the whole SwiGLU FFN in one kernel (batch-1 decode):

    y[n, j] = w_down[e](activation(x[n] @ w_gate[e]) * (x[n] @ w_up[e])),  e = ids[n, j]

x [N, E] (N <= MAX_TOKENS), ids int32[N, k] (an id < 0 or >= the number of experts: routed
nowhere, its row is zero), w_gate / w_up [G, E, I], w_down [G, I, E] -> y float32[N, k, E],
each pair's output, unweighted (`expert_tile_swiglu`'s contract); `fused_moe_ffn` returns
the routing-weighted sum [N, E].

Program (p, c) owns pair p's expert and its hidden columns [c * block_n, (c + 1) * block_n):
it reads those columns of the gate and up weights (all E rows: the hidden values are
complete), applies the activation, and multiplies its block_n hidden values by the same rows
of the down weight, writing a float32 partial [E] of the expert's output. The wrapper sums
the I / block_n partials. So every weight byte is read once, by one program, and the layer
is one launch: at one DeepSeek-V2-Lite token, k x I / block_n = 6 x 22 = 132 programs (one
per H100 SM) read 104 MB in one wave, where the two-kernel form (`expert_tile_swiglu`) pays
each kernel's ramp-up and tail and the split-K sums between them (docs/kernels.md; its
measured rate is in docs/benchmarks.md).

Up to MAX_TOKENS tokens; the model takes it up to `mtpjax.model.grouped_matmul.
fused_moe_tokens()` (a batch of one decoding, or `generate`'s two rows of which the second
pads; with drafts, a verify's K+1 tokens). A padding token's pairs are routed nowhere and
cost a zero write. Each pair reads its expert on its own, so tokens that chose one expert
read it once each: beyond a few tokens `expert_tile_swiglu` (one tile per touched expert)
reads fewer bytes.

Shared experts (DeepSeek's always-on SwiGLU of width S = n_shared x I; SGLang's "shared
experts fusion"): `fused_moe_ffn` can run them in the same launch, where XLA's form is two
small GEMVs and their split / activation / add (three or four more launches a layer at one
token). The shared FFN is cut into S / I chunks of I hidden columns, each one more pair of
weight 1, so the column blocks, loops and partials are the routed pairs' own. The chunks
read the params as they are: `shared_gate_up` [E, 2S] (gate columns [0, S), up [S, 2S)) or
`shared_gate` / `shared_up` [E, S], and `shared_down` [S, E], through dynamic slices, with
no copy. A chunk's programs (one per column block, before the routed ones in the grid) take
all N tokens as the dot's rows, so the shared weights are read once whatever N (a pair per
token would read them N times at a verify's four tokens); a padding token's row is zero,
and with every token padding they read nothing. Each kind of program has its own loops,
with dynamic trip counts (the other kind's zero).

Triton's dot takes at least 16 rows, so each x block is widened in registers to 16 rows, x
then 15 zero rows (no padding kernel before the launch): their hidden values are
activation(0) x 0 = 0 and their outputs zero, and each partial is the sum of its rows (row 0
plus exact zeros) with no value slicing in the kernel; a shared program's token t is row t,
its partial the sum of row t alone.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._device import num_sms
from pallas_kernels.grouped_matmul.grouped_matmul import (SUPPORTED_DTYPES, check_ffn_weights,
                                                          largest_block)

DOT_ROWS = 16                   # Triton's smallest dot: x's one row, then zero rows
MAX_TOKENS = 8                  # the kernel's limit (the model's choice: fused_moe_tokens)
STAGE_BYTES = 64 * 1024         # gate + up weight bytes per pipeline step (bf16)
# pipeline stages by default: with the shared experts' programs in the grid, 2 stages ran
# faster than 3 at one to four V2-Lite tokens on the H200 (3 was, and stays, the routed-only
# kernel's best)
DEFAULT_STAGES, SHARED_STAGES = 3, 2


def target_programs() -> int:
    """About one program per SM, leaving at most 1/32 of them idle (128 of an H100's 132):
    the layer is one wave, so every SM must share the weight read."""
    sms = num_sms()
    return sms - sms // 32


def default_blocks(pairs: int, E: int, I: int) -> tuple[int, int, int]:
    """(block_n, block_k, block_e) for one token's `pairs` expert pairs (its k routed experts
    and the shared experts' S / I chunks). block_n: hidden columns per program, halved from
    128 until the pairs x I / block_n programs reach `target_programs()`.
    block_k: rows of E per gate/up step, as many as fit STAGE_BYTES (256 at 64 columns).
    block_e: 256 output columns per down step.

    Chosen by an H100 sweep at one V2-Lite token (kernel time alone; docs/kernels.md). A
    wide step, not a deep pipeline, keeps enough bytes in flight: with 128-row
    steps, 2 stages ran faster than 3, 4 or 5. At the V3 slice (8 of 128 experts) 128
    columns beat 64."""
    bn = largest_block(I, 128)
    target = target_programs()
    while bn > 16 and pairs * (I // bn) < target and I % (bn // 2) == 0:
        bn //= 2
    rows = max(16, STAGE_BYTES // (2 * 2 * bn))
    return bn, largest_block(E, min(rows, 256)), largest_block(E, 256)


def fused_ffn_kernel(x_ref, wg_ref, wu_ref, wd_ref, *refs, k: int, n_shared: int,
                     up_offset: int, block_n: int, block_k: int, block_e: int, activation):
    """Program (j, c) owns hidden block c of one pair: for j < n_shared shared chunk s = j
    (hidden columns [s I, (s + 1) I) of the shared FFN) for all N tokens at once, writing
    o_ref[t, (k + s) * n_cols + c] for every token t (0 for a padding one); then routed pair
    q = j - n_shared (token q // k, slot q % k), writing o_ref[q // k, (q % k) * n_cols + c]
    = its float32 partial [E] times the routing weight. x_ref [N, E], o_ref [N, slots, E]
    (whole arrays: a shared program writes every token's row). The shared programs come
    first: with several tokens they run longest (a dot row and a store per token), so they
    start in the first wave rather than trail the last.

    refs: ids_ref int32[N * k], scale_ref f32[N * k], then with n_shared chunks sg_ref /
    su_ref (the shared gate and up columns: one [E, 2S] array twice with up_offset S, or two
    [E, S] with up_offset 0), sd_ref [S, E] and valid_ref int32[N], then o_ref."""
    if n_shared:
        ids_ref, scale_ref, sg_ref, su_ref, sd_ref, valid_ref, o_ref = refs
    else:
        ids_ref, scale_ref, o_ref = refs
    G, E, I = wg_ref.shape
    N = x_ref.shape[0]
    n_cols = I // block_n
    j, c = pl.program_id(0), pl.program_id(1)
    pair = jnp.maximum(j - n_shared, 0)                # a shared program reads pair 0's
    n = pair // k
    g = ids_ref[pair]
    routed = (j >= n_shared) & (g >= 0) & (g < G)
    g = jnp.where(routed, g, 0)
    cols = pl.ds(c * block_n, block_n)
    # float32 inputs: full-precision dots (Triton would use TF32), as the f32 tests compare
    precision = lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None
    # int32 bounds on both ends: Triton's scf.for needs one type (expert_tiles' kernel.py)
    zero_i = jnp.int32(0)
    row_k = lax.broadcasted_iota(jnp.int32, (DOT_ROWS, block_k), 0)
    row_e = lax.broadcasted_iota(jnp.int32, (DOT_ROWS, block_e), 0)

    def x_rows(tokens, rows):
        """x's rows `rows` of the given tokens in the dot's rows 0, 1, ... (tokens: (token,
        keep) pairs; a token not kept, and the rows past them, are 0) -> [16, block_k]."""
        x = jnp.zeros((DOT_ROWS, block_k), x_ref.dtype)
        for i, (t, keep) in enumerate(tokens):
            x_t = jnp.broadcast_to(x_ref[pl.ds(t, 1), rows], (DOT_ROWS, block_k))
            x = jnp.where((row_k == i) & keep, x_t, x)
        return x

    def gate_up(tokens, gate_w, up_w):
        """The loop body over E for gate / up weights read by gate_w(rows) / up_w(rows)."""
        def step(i, accs):
            rows = pl.ds(i * block_k, block_k)
            x = x_rows(tokens, rows)
            return (accs[0] + plgpu.dot(x, gate_w(rows), precision=precision),
                    accs[1] + plgpu.dot(x, up_w(rows), precision=precision))
        return step

    def down(down_w, store):
        """The loop body over E's output blocks for down weights read by down_w(out); store(
        out, y) writes the dot's rows [16, block_e]."""
        def step(i, carry):
            out = pl.ds(i * block_e, block_e)
            store(out, plgpu.dot(h, down_w(out), precision=precision))
            return carry
        return step

    def routed_store(out, y):
        o_ref[n, (pair % k) * n_cols + c, out] = jnp.sum(y, axis=0) * scale_ref[pair]

    def zeros(store):
        """The loop body writing zeros by store(out, y) where a program read nothing."""
        def step(i, carry):
            store(pl.ds(i * block_e, block_e), jnp.zeros((DOT_ROWS, block_e), jnp.float32))
            return carry
        return step

    # Each kind of pair (routed, shared) has its own loops, of which a program runs one set:
    # dynamic trip counts (the other kind's zero), not branches, keep the loads pipelined.
    n_k, n_e = jnp.int32(E // block_k), jnp.int32(E // block_e)
    zero = jnp.zeros((DOT_ROWS, block_n), jnp.float32)
    acc = lax.fori_loop(zero_i, jnp.where(routed, n_k, zero_i),      # routed nowhere: no reads
                        gate_up([(n, True)], lambda rows: wg_ref[g, rows, cols],
                                lambda rows: wu_ref[g, rows, cols]), (zero, zero))
    if n_shared:
        s = jnp.minimum(j, n_shared - 1)
        valid = [valid_ref[t] != 0 for t in range(N)]
        # every token padding: the shared programs read nothing
        shared = (j < n_shared) & functools.reduce(jnp.logical_or, valid)
        hidden = s * I + c * block_n                                  # shared FFN columns
        gate_cols = pl.ds(hidden, block_n)
        up_cols = pl.ds(up_offset + hidden, block_n)
        acc = lax.fori_loop(zero_i, jnp.where(shared, n_k, zero_i),
                            gate_up(list(zip(range(N), valid)),
                                    lambda rows: sg_ref[rows, gate_cols],
                                    lambda rows: su_ref[rows, up_cols]), acc)
    gate, up = acc
    h = (activation(gate) * up).astype(x_ref.dtype)                     # [16, block_n]

    # A pair routed nowhere writes zeros without reading a weight: the partials need no mask
    # (a select before the sum was its own small kernel on the H100).
    n_routed_e = jnp.where(routed, n_e, zero_i)
    lax.fori_loop(zero_i, n_routed_e, down(lambda out: wd_ref[g, cols, out], routed_store),
                  zero_i)
    lax.fori_loop(zero_i, jnp.where(j >= n_shared, n_e - n_routed_e, zero_i), zeros(routed_store),
                  zero_i)
    if not n_shared:
        return

    def shared_store(out, y):
        # row t of the dot is token t's (a padding token's row: x 0, so h 0 and y 0)
        for t in range(N):
            o_ref[t, (k + s) * n_cols + c, out] = jnp.sum(jnp.where(row_e == t, y, 0.0), 0)

    n_shared_e = jnp.where(shared, n_e, zero_i)
    lax.fori_loop(zero_i, n_shared_e, down(lambda out: sd_ref[gate_cols, out], shared_store),
                  zero_i)
    lax.fori_loop(zero_i, jnp.where(j < n_shared, n_e - n_shared_e, zero_i), zeros(shared_store),
                  zero_i)


def _shared_operands(shared_gate_up, shared_gate, shared_up, shared_down, E, I, dtype):
    """(gate ref, up ref, down ref, up_offset, n_shared) for the kernel's shared chunks, or
    None without shared experts; ValueError naming the bad shape or dtype."""
    given = {name: w for name, w in (("shared_gate_up", shared_gate_up),
                                     ("shared_gate", shared_gate), ("shared_up", shared_up),
                                     ("shared_down", shared_down)) if w is not None}
    if not given:
        return None
    if set(given) not in ({"shared_gate_up", "shared_down"},
                          {"shared_gate", "shared_up", "shared_down"}):
        raise ValueError("shared experts take shared_gate_up and shared_down, or shared_gate, "
                         f"shared_up and shared_down; got {sorted(given)}")
    S = shared_down.shape[0] if shared_down.ndim == 2 else -1
    if shared_down.shape != (S, E) or S <= 0 or S % I:
        raise ValueError(f"shared_down must be [S, E={E}] with S a positive multiple of the "
                         f"expert width I={I}, got {tuple(shared_down.shape)}")
    if shared_gate_up is not None:
        if shared_gate_up.shape != (E, 2 * S):
            raise ValueError(f"shared_gate_up must be [E={E}, 2S={2 * S}] (gate | up), got "
                             f"{tuple(shared_gate_up.shape)}")
        gate, up, up_offset = shared_gate_up, shared_gate_up, S
    else:
        for name in ("shared_gate", "shared_up"):
            if given[name].shape != (E, S):
                raise ValueError(f"{name} must be [E={E}, S={S}], got "
                                 f"{tuple(given[name].shape)}")
        gate, up, up_offset = shared_gate, shared_up, 0
    for name, w in given.items():
        if w.dtype != dtype:
            raise ValueError(f"{name} must be {jnp.dtype(dtype).name} like x and the experts, "
                             f"got {w.dtype}")
    return gate, up, shared_down, up_offset, S // I


def _routed_partials(x, ids, scale, w_gate, w_up, w_down, *, activation, block_n, block_k,
                     block_e, num_warps, num_stages, interpret, shared_gate_up=None,
                     shared_gate=None, shared_up=None, shared_down=None, valid=None):
    """The kernel's float32 partials [N, pairs x I / block_n, E], pairs = k + the shared
    chunks: token n's row p * n_cols + c is its pair p's (routed slot, then shared chunk)
    partial over hidden block c (zero for pairs routed nowhere and a padding token's shared
    chunks), after checking the operands (ValueError naming the bad one)."""
    _, E, I = check_ffn_weights(w_gate, w_up, w_down)
    if x.ndim != 2 or not 1 <= x.shape[0] <= MAX_TOKENS or x.shape[1] != E:
        raise ValueError(f"x must be [N, E={E}] with 1 <= N <= {MAX_TOKENS} tokens, got "
                         f"{tuple(x.shape)}")
    N = x.shape[0]
    if ids.ndim != 2 or ids.shape[0] != N or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"ids must be integers [N={N}, k], got {ids.dtype}{list(ids.shape)}")
    if (jnp.dtype(x.dtype) not in SUPPORTED_DTYPES
            or {w.dtype for w in (w_gate, w_up, w_down)} != {x.dtype}):
        raise ValueError(f"x and the weights must all be bfloat16 or all float32, got x "
                         f"{x.dtype}, weights {w_gate.dtype} / {w_up.dtype} / {w_down.dtype}")
    k = ids.shape[1]
    if scale.shape != (N, k):
        raise ValueError(f"weights must be [N={N}, k={k}] like ids, got {tuple(scale.shape)}")
    shared = _shared_operands(shared_gate_up, shared_gate, shared_up, shared_down, E, I,
                              x.dtype)
    n_shared = shared[-1] if shared else 0
    if valid is not None and valid.shape != (N,):
        raise ValueError(f"valid must be [N={N}], got {tuple(valid.shape)}")
    pairs = k + n_shared
    auto = default_blocks(pairs, E, I)  # one token's pairs fill the GPU (the others: padding)
    block_n, block_k, block_e = (b or a for b, a in zip((block_n, block_k, block_e), auto))
    for name, b, dim, dim_name in (("block_n", block_n, I, "I"), ("block_k", block_k, E, "E"),
                                   ("block_e", block_e, E, "E")):
        if b < 16 or b & (b - 1) or dim % b:
            raise ValueError(f"{name}={b} must be a power of two >= 16 (Triton's dot) dividing "
                             f"{dim_name}={dim}")
    n_cols = I // block_n
    num_stages = num_stages or (SHARED_STAGES if n_shared else DEFAULT_STAGES)
    operands = [ids.reshape(N * k).astype(jnp.int32), scale.reshape(N * k).astype(jnp.float32)]
    if shared:
        ok = jnp.ones(N, jnp.int32) if valid is None else valid.astype(jnp.int32)
        operands += [*shared[:3], ok]
    kernel = functools.partial(fused_ffn_kernel, k=k, n_shared=n_shared,
                               up_offset=shared[3] if shared else 0, block_n=block_n,
                               block_k=block_k, block_e=block_e, activation=activation)
    return pl.pallas_call(
        kernel,
        grid=(n_shared + N * k, n_cols),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * (4 + len(operands)),
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        out_shape=jax.ShapeDtypeStruct((N, pairs * n_cols, E), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="fused_expert_ffn",
    )(x, w_gate, w_up, w_down, *operands)


_STATIC = ("activation", "block_n", "block_k", "block_e", "num_warps", "num_stages",
           "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def fused_expert_ffn(x: jax.Array, ids: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                     w_down: jax.Array, *, activation=jax.nn.silu, block_n: int | None = None,
                     block_k: int | None = None, block_e: int | None = None,
                     num_warps: int = 4, num_stages: int = 3,
                     interpret: bool = False) -> jax.Array:
    """See the module docstring: y float32[N, k, E], each pair's output unweighted. Blocks not
    given come from `default_blocks`. ValueError for shapes, dtypes or blocks the kernel
    cannot take."""
    ones = jnp.ones(ids.shape, jnp.float32)
    partials = _routed_partials(
        x, ids, ones, w_gate, w_up, w_down, activation=activation, block_n=block_n,
        block_k=block_k, block_e=block_e, num_warps=num_warps, num_stages=num_stages,
        interpret=interpret)
    N, k = ids.shape
    return partials.reshape(N, k, -1, partials.shape[-1]).sum(2)


@functools.partial(jax.jit, static_argnames=_STATIC)
def fused_moe_ffn(x: jax.Array, ids: jax.Array, weights: jax.Array, w_gate: jax.Array,
                  w_up: jax.Array, w_down: jax.Array, *, shared_gate_up: jax.Array | None = None,
                  shared_gate: jax.Array | None = None, shared_up: jax.Array | None = None,
                  shared_down: jax.Array | None = None, valid: jax.Array | None = None,
                  activation=jax.nn.silu, block_n: int | None = None,
                  block_k: int | None = None, block_e: int | None = None, num_warps: int = 4,
                  num_stages: int | None = None, interpret: bool = False) -> jax.Array:
    """The routed experts' weighted sum: sum_j weights[n, j] * y[n, j] -> float32 [N, E]
    (weights float [N, k]). The kernel scales each partial by its pair's weight, so the
    partials' sum is the layer's output: one reduction after the launch, where the unweighted
    form's sum, weighting and sum over k were two or three small kernels.

    With the shared experts (shared_gate_up [E, 2S] (gate | up) or shared_gate / shared_up
    [E, S] each, and shared_down [S, E]; S a multiple of I) the sum also holds each valid
    token's shared SwiGLU, run as S / I more pairs of weight 1 for all tokens at once, which
    read the arrays in place. valid bool[N] (default all): a token False is padding, adding
    nothing (its x never enters the shared dots; its routed pairs: route it nowhere), and
    when all are, the shared pairs read nothing. num_stages None: SHARED_STAGES with
    the shared experts, else DEFAULT_STAGES. ValueError as `fused_expert_ffn`, or naming a
    bad shared weight."""
    partials = _routed_partials(
        x, ids, weights, w_gate, w_up, w_down, activation=activation, block_n=block_n,
        block_k=block_k, block_e=block_e, num_warps=num_warps, num_stages=num_stages,
        interpret=interpret, shared_gate_up=shared_gate_up, shared_gate=shared_gate,
        shared_up=shared_up, shared_down=shared_down, valid=valid)
    return partials.sum(1)
