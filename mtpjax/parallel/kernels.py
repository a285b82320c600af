"""The Pallas attention kernels on a mesh: each device runs the kernel on its own heads.

A Pallas kernel is one device's program; XLA cannot partition it. Under a mesh of several
devices `AttentionBackend.paged_attention` therefore calls the kernel inside `shard_map`:

    q        [N, NH, hd]       split by head over "model"
    pages    [KVH, P, S, hd]   split by KV head over "model" when KVH divides it (the table's
                               GQA layout); one shared KV head (MLA latent pages) replicated
    batch    (positions, block tables, kv lens, cu_q_lens)   replicated
    out      [N, NH, hd_v]     split by head over "model"

Each device's query heads then map to its own KV heads (head h uses KV head h // (NH / KVH),
and a contiguous block of NH / m heads covers exactly KVH / m KV heads), so no collective is
needed. The "data" axis replicates the call. Any other layout is a ValueError naming it for an
explicit "pallas" backend; "auto" (fallback) warns once and runs the reference instead.
"""

from __future__ import annotations

import functools
import warnings

import jax
from jax.sharding import PartitionSpec as P


_warned: set = set()


def shard_map_compat(f, *, mesh, in_specs, out_specs):
    """`jax.shard_map` (JAX >= 0.7), else `jax.experimental.shard_map.shard_map`; no
    replication checks (a pallas_call carries no replication rule)."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)
    from jax.experimental.shard_map import shard_map   # pragma: no cover (old JAX)
    return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def kernel_layout(num_heads: int, num_kv_heads: int, model: int) -> str:
    """"split" (pages by KV head) | "shared" (one KV head, replicated); ValueError otherwise."""
    if num_heads % model:
        raise ValueError(f"the Pallas attention kernels on a mesh split query heads over the "
                         f"'model' axis: num_heads={num_heads} is not divisible by its size "
                         f"{model}; use attention_impl='reference' or a model axis dividing it")
    if num_kv_heads % model == 0:
        return "split"
    if num_kv_heads == 1:
        return "shared"
    raise ValueError(f"the Pallas attention kernels on a mesh need the KV heads split over the "
                     f"'model' axis: num_kv_heads={num_kv_heads} is not divisible by its size "
                     f"{model} (such pages are replicated, which only the reference reads); use "
                     "attention_impl='reference' or a model axis dividing num_kv_heads")


def per_device_paged_attention(backend, q, k_pages, v_pages, batch, *, sm_scale=None):
    """backend.paged_attention's kernel path on backend.mesh (see the module docstring)."""
    from mtpjax.model import pallas_dispatch
    mesh = backend.mesh
    model = int(mesh.shape["model"])
    try:
        layout = kernel_layout(q.shape[1], k_pages.shape[0], model)
    except ValueError as e:
        if not backend.fallback:                     # an explicit "pallas": say why not
            raise
        if str(e) not in _warned:                    # "auto": the reference, partitioned by XLA
            _warned.add(str(e))
            warnings.warn(f"{e}; using the reference attention")
        from mtpjax.model.attention import paged_attention_reference
        return paged_attention_reference(q, k_pages, v_pages, batch, sm_scale=sm_scale)
    heads = P(None, "model") if model > 1 else P()
    pages = P("model") if layout == "split" and model > 1 else P()
    kernel = functools.partial(pallas_dispatch.paged_attention, sm_scale=sm_scale,
                               interpret=backend.interpret, fallback=backend.fallback)
    run = shard_map_compat(lambda q_, k_, v_, b_: kernel(q_, k_, v_, b_), mesh=mesh,
                           in_specs=(heads, pages, pages, P()), out_specs=heads)
    return run(q, k_pages, v_pages, batch)
