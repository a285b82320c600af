"""`Fp8Weight`: a projection weight kept in FP8 (e4m3) with float32 block scales.

In mtpjax's layout (`x @ w`, w [in, out]; stacked experts [X, in, out]) a quantized weight is

    values  float8_e4m3fn [..., E, N]
    scale   float32       [..., ceil(E / bE), ceil(N / bN)]
    W[..., i, j] = float32(values[..., i, j]) * scale[..., i // bE, j // bN]

`block = (bE, bN)` is static. DeepSeek-V3's `weight_scale_inv` is this grid in Hugging Face's
[out, in] orientation (128 x 128 blocks): loading transposes values and scale together, so the
block becomes (bE, bN) = (128, 128) here too. A per-output-channel scale (the layout of most
other FP8 checkpoints) is the block (E, 1): one scale row, one column per output. The last row /
column of blocks may be partial.

The weight is a registered pytree (values and scale are its leaves), so it sits in the param tree
where the bf16 array was, flows through jit, the sharding table, Orbax and export. `dtype` is the
dtype it stands for (what `dequantize` returns, the dtype of the weight it replaced): code that
asks a leaf for its dtype or shape sees the logical weight, `values.dtype` is the stored FP8.

Matmuls read it through `dequantize()` inside the jitted step: convert, multiply by the
broadcast scale, dot. The dequantized reference model (`dequantize_params`) runs the very same
products, so the two agree to rounding of the dot only.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0                        # largest finite float8_e4m3fn


@struct.dataclass
class Fp8Weight:
    values: jax.Array                  # float8_e4m3fn [..., E, N]
    scale: jax.Array                   # float32 [..., ceil(E / bE), ceil(N / bN)]
    block: tuple[int, int] = struct.field(pytree_node=False)       # (bE, bN)
    out_dtype: str = struct.field(pytree_node=False, default="bfloat16")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def ndim(self) -> int:
        return len(self.values.shape)

    @property
    def dtype(self) -> np.dtype:
        """The dtype this weight stands for (dequantizes to); the values are FP8."""
        return jnp.dtype(self.out_dtype)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.values) + _nbytes(self.scale)

    def expanded_scale(self) -> jax.Array:
        """scale broadcast to the values' shape [..., E, N] (float32)."""
        E, N = self.values.shape[-2:]
        bE, bN = self.block
        s = jnp.repeat(self.scale, bE, axis=-2)[..., :E, :] if bE > 1 else self.scale[..., :E, :]
        return jnp.repeat(s, bN, axis=-1)[..., :N] if bN > 1 else s[..., :N]

    def dequantize(self, dtype=None) -> jax.Array:
        """values * scale in float32, then cast to `dtype` (default: the weight's `dtype`)."""
        w = self.values.astype(jnp.float32) * self.expanded_scale()
        return w.astype(dtype or self.dtype)

    @property
    def T(self) -> "Fp8Weight":
        """The transposed weight ([..., N, E]; block (bN, bE)): Hugging Face's orientation."""
        return Fp8Weight(jnp.swapaxes(self.values, -1, -2) if isinstance(self.values, jax.Array)
                         else np.swapaxes(self.values, -1, -2),
                         jnp.swapaxes(self.scale, -1, -2) if isinstance(self.scale, jax.Array)
                         else np.swapaxes(self.scale, -1, -2),
                         (self.block[1], self.block[0]), self.out_dtype)


def _nbytes(a) -> int:
    return math.prod(a.shape) * np.dtype(a.dtype).itemsize


def is_fp8(x) -> bool:
    return isinstance(x, Fp8Weight)


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """Scale shape of a weight of `shape` [..., E, N] in blocks (bE, bN)."""
    return (*shape[:-2], *(-(-n // b) for n, b in zip(shape[-2:], block)))


def check_block(block, shape: tuple[int, ...] | None = None) -> tuple[int, int]:
    """A (bE, bN) pair of positive ints, or a ValueError naming the bad value."""
    try:
        bE, bN = (int(b) for b in block)
        ok = bE > 0 and bN > 0 and all(float(b) == int(b) for b in block)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"FP8 block {block!r}: expected two positive ints (rows, cols) such "
                         "as (128, 128), or 'channel' for per-output-channel scales")
    if shape is not None and len(shape) < 2:
        raise ValueError(f"FP8 weights are matrices [..., in, out]; got shape {tuple(shape)}")
    return bE, bN


def quantize(w, block: tuple[int, int]) -> Fp8Weight:
    """w [..., E, N] (any float dtype) -> Fp8Weight with scale = block amax / 448 (DeepSeek's
    recipe: every block's largest element maps to e4m3's largest; an all-zero block gets scale 1).
    Each element's error is at most 2^-4 of its magnitude (3 mantissa bits, round to nearest)
    down to the subnormal range, 2^-10 of its block's scale below it."""
    w = jnp.asarray(w)
    bE, bN = check_block(block, w.shape)
    values, scale = _quantize(w, (bE, bN))
    return Fp8Weight(values, scale, (bE, bN), jnp.dtype(w.dtype).name)


@functools.partial(jax.jit, static_argnums=1)       # one compile per shape, not one per op
def _quantize(w: jax.Array, block: tuple[int, int]):
    bE, bN = block
    *lead, E, N = w.shape
    r, c = -(-E // bE), -(-N // bN)
    x = jnp.pad(w.astype(jnp.float32), [(0, 0)] * len(lead) + [(0, r * bE - E), (0, c * bN - N)])
    blocks = x.reshape(*lead, r, bE, c, bN)
    amax = jnp.max(jnp.abs(blocks), axis=(-3, -1))                    # [..., r, c]
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)
    q = blocks / scale[..., :, None, :, None]
    q = jnp.clip(q, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return q.reshape(*lead, r * bE, c * bN)[..., :E, :N], scale


def dequantize_leaf(x, dtype=None):
    """An Fp8Weight -> its dequantized array; anything else unchanged."""
    return x.dequantize(dtype) if isinstance(x, Fp8Weight) else x


def dequantize_in_step(w, x):
    """(w as a plain array, x) for a matmul of the activation x by w inside a step: an
    Fp8Weight is dequantized behind one optimization barrier shared with x. Untied, the
    dequantization depends on nothing the loop changes, and XLA's loop-invariant code motion
    hoists it out of `generate`'s while loop: the optimized HLO then carried a dequantized copy
    of every FP8 weight through the loop and no FP8 at all (tests/model/test_fp8_weights.py checks the
    loop's operands). Tied to x, which changes every iteration, it stays where the matmul is.
    Anything else passes through unchanged."""
    if not isinstance(w, Fp8Weight):
        return w, x
    values, scale, x = jax.lax.optimization_barrier((w.values, w.scale, x))
    return Fp8Weight(values, scale, w.block, w.out_dtype).dequantize(), x


def partition_specs(values_spec, w: Fp8Weight, mesh_shape) -> tuple:
    """(values PartitionSpec, scale PartitionSpec) for an Fp8Weight whose logical weight the
    sharding table splits as `values_spec`. A split of one of the two blocked dims is kept only
    when every device's slice is whole blocks ((dim / n) % b == 0: the scale grid splits the same
    way) or the scale has a single block along it (per-output-channel rows: the scale is
    replicated along it and broadcasts on every device); otherwise that dim is replicated for
    both, so every device's values and scale always match. Leading dims (experts) split alike."""
    from jax.sharding import PartitionSpec as P
    nd = len(w.shape)
    axes = list(values_spec) + [None] * (nd - len(values_spec))
    scale_axes = list(axes)
    for d, b in zip((nd - 2, nd - 1), w.block):
        axis = axes[d]
        if axis is None:
            continue
        n = math.prod(int(mesh_shape[a]) for a in (axis if isinstance(axis, tuple) else (axis,)))
        if w.scale.shape[d] == 1:
            scale_axes[d] = None
        elif (w.shape[d] // n) % b:
            axes[d] = scale_axes[d] = None

    def spec(a):
        while a and a[-1] is None:
            a = a[:-1]
        return P(*a)

    return spec(axes), spec(scale_axes)


def shard_like(w: Fp8Weight, sharding):
    """An Fp8Weight of NamedShardings for `w` from the table's sharding of its logical weight
    (a NamedSharding); other shardings apply to both leaves as they are."""
    from jax.sharding import NamedSharding
    if not isinstance(sharding, NamedSharding):
        return Fp8Weight(sharding, sharding, w.block, w.out_dtype)
    v, s = partition_specs(sharding.spec, w, sharding.mesh.shape)
    return Fp8Weight(NamedSharding(sharding.mesh, v), NamedSharding(sharding.mesh, s),
                     w.block, w.out_dtype)


def concatenate_out(ws: list) -> Fp8Weight | None:
    """FP8 weights [E, N_i] of one block size joined along the output axis -> [E, sum N_i], or
    None when a block would straddle two of them (an N_i not a multiple of bN) or the blocks
    differ: then the caller keeps them apart."""
    first = ws[0]
    if not all(isinstance(w, Fp8Weight) and w.block == first.block
               and w.out_dtype == first.out_dtype and w.shape[:-1] == first.shape[:-1]
               for w in ws):
        return None
    if any(w.shape[-1] % first.block[1] for w in ws[:-1]):
        return None
    return Fp8Weight(jnp.concatenate([w.values for w in ws], axis=-1),
                     jnp.concatenate([w.scale for w in ws], axis=-1), first.block,
                     first.out_dtype)


def leaf_partition_spec(spec, leaf, mesh_shape):
    """The table's PartitionSpec of a param leaf as a pytree prefix for that leaf: `spec` itself
    for an array, an Fp8Weight of (values, scale) specs (`partition_specs`) for an FP8 weight
    (shard_map's in_specs, jit's shardings)."""
    if not isinstance(leaf, Fp8Weight):
        return spec
    v, s = partition_specs(spec, leaf, mesh_shape)
    return Fp8Weight(v, s, leaf.block, leaf.out_dtype)
