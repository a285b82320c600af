"""The Pallas attention kernels on a mesh: each device runs the kernel on its own heads.

A Pallas kernel is one device's program; XLA cannot partition it. Under a mesh of several
devices the attention dispatch (`AttentionBackend.paged_attention`) therefore calls the kernel
its route picked inside `shard_map`, through the mesh layer this module registers on import
(parallel/ imports model/, never the reverse):

    q        [N, NH, hd]       split by head over "model"
    pages    [KVH, P, S, hd]   split by KV head over "model" when KVH divides it (the table's
                               GQA layout); one shared KV head (MLA latent pages) replicated
    batch    (positions, block tables, kv lens, cu_q_lens)   replicated
    out      [N, NH, hd_v]     split by head over "model"

Each device's query heads then map to its own KV heads (head h uses KV head h // (NH / KVH),
and a contiguous block of NH / m heads covers exactly KVH / m KV heads), so no collective is
needed. The "data" axis replicates the call. Any other layout is one more reason the kernels
cannot serve the call (`layout_unsupported_reason`), fed into the dispatch's one fallback
decision: a ValueError naming it for an explicit "pallas" backend; "auto" warns once and runs
the reference instead (partitioned by XLA).
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from mtpjax.model.backend import register_mesh_layer


def shard_map_compat(f, *, mesh, in_specs, out_specs):
    """`jax.shard_map` (JAX >= 0.7), else `jax.experimental.shard_map.shard_map`; no
    replication checks (a pallas_call carries no replication rule)."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)
    from jax.experimental.shard_map import shard_map   # pragma: no cover (old JAX)
    return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def layout_unsupported_reason(num_heads: int, num_kv_heads: int, model: int) -> str | None:
    """Why the kernels cannot run per device with these head counts on a "model" axis of size
    `model` (worded to follow "the Pallas attention kernels do not support ..."), or None."""
    if num_heads % model:
        return (f"query heads split over the 'model' mesh axis unevenly: num_heads={num_heads} "
                f"is not divisible by its size {model} (use a model axis dividing it)")
    if num_kv_heads % model and num_kv_heads != 1:
        return (f"KV heads replicated over the 'model' mesh axis: num_kv_heads={num_kv_heads} "
                f"is not divisible by its size {model} (such pages are replicated, which only "
                "the reference reads; use a model axis dividing num_kv_heads)")
    return None


def kernel_layout(num_heads: int, num_kv_heads: int, model: int) -> str:
    """"split" (pages by KV head) | "shared" (one KV head, replicated); ValueError otherwise."""
    reason = layout_unsupported_reason(num_heads, num_kv_heads, model)
    if reason is not None:
        raise ValueError(f"the Pallas attention kernels do not support {reason}")
    return "split" if num_kv_heads % model == 0 else "shared"


class PerDeviceKernels:
    """The mesh layer of `model/backend.py`: the layout rule and the shard_map around a kernel."""

    def unsupported_reason(self, num_heads: int, num_kv_heads: int, mesh) -> str | None:
        return layout_unsupported_reason(num_heads, num_kv_heads, int(mesh.shape["model"]))

    def per_device(self, kernel, q, pages, batch, *, num_kv_heads: int, mesh):
        """kernel(q, pages, batch) with q [N, NH, hd] and the out split by head over "model",
        the pages (every array of the pytree) by KV head or replicated, the batch replicated."""
        model = int(mesh.shape["model"])
        layout = kernel_layout(q.shape[1], num_kv_heads, model)
        heads = P(None, "model") if model > 1 else P()
        page_spec = P("model") if layout == "split" and model > 1 else P()
        run = shard_map_compat(kernel, mesh=mesh, in_specs=(heads, page_spec, P()),
                               out_specs=heads)
        return run(q, pages, batch)


register_mesh_layer(PerDeviceKernels())
