"""The attention backend of a run: one static object instead of `impl` strings.

    reference         plain jnp (gathers pages; what CPU runs, what every kernel is tested against)
    pallas            the Pallas GPU kernels of `pallas_kernels/`
    pallas_interpret  the same kernels interpreted (CPU tests)

`resolve_backend("auto")` picks "pallas" on GPU and "reference" elsewhere; the environment
variable MTPJAX_ATTENTION_IMPL overrides "auto". Only "auto" may fall back to the reference for
a shape the kernels cannot serve (it says so once); an explicit "pallas" raises instead, naming
the shape. The object is frozen and hashable: jitted steps take it as one static argument.
It also carries the run's device mesh (None: one device): the steps pin their state to the
sharding table on it, and on a mesh of several devices the kernels run per device under
`shard_map`.

`AttentionBackend.paged_attention` is the one attention dispatch. The pages' type names its
route (`attention_routes.py`: reference, kernels, which shapes the kernels serve); on a mesh of
several devices the mesh layer (`parallel/kernels.py`, which registers itself here with
`register_mesh_layer`: parallel/ imports model/, never the reverse) adds its own layout rule
and runs the kernel per device. Every "why not the kernel" reason meets one decision: reference,
warn once and reference, or a ValueError naming the shape.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from typing import Protocol

import jax

ATTENTION_IMPLS = ("auto", "reference", "pallas", "pallas_interpret")


class MeshLayer(Protocol):
    """Runs a one-device attention kernel on a mesh of several devices (`parallel/kernels.py`)."""

    def unsupported_reason(self, num_heads: int, num_kv_heads: int, mesh) -> str | None: ...
    def per_device(self, kernel, q, pages, batch, *, num_kv_heads: int, mesh): ...


_mesh_layer: list = []          # the registered MeshLayer (one at most)
_warned: set = set()            # fallback reasons already warned about


def register_mesh_layer(layer: MeshLayer) -> MeshLayer:
    _mesh_layer[:] = [layer]
    return layer


def _registered_mesh_layer(mesh) -> MeshLayer:
    if not _mesh_layer:
        raise RuntimeError(f"the Pallas attention kernels on a mesh of {mesh.size} devices need "
                           "the mesh layer: import mtpjax.parallel (`import mtpjax` does)")
    return _mesh_layer[0]


@dataclasses.dataclass(frozen=True)
class SplitTokens:
    """Inside a `shard_map` over the mesh axis `axis` of `size` devices, each device holding the
    tokens of its own requests (data-parallel attention, `parallel/dp_attention.py`): attention
    runs per device as on one device, and the MoE layer gathers every device's tokens over
    `axis` before its experts (split over the same axis) and scatters the outputs back."""
    axis: str
    size: int


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    impl: str = "reference"        # "reference" | "pallas" | "pallas_interpret"
    fallback: bool = False         # chosen by "auto": unsupported shapes use the reference
    mesh: object = None            # jax.sharding.Mesh ("data", "model") or None
    split_tokens: SplitTokens | None = None   # set inside the DP-attention shard_map (mesh None)

    def __post_init__(self):
        if self.impl not in ATTENTION_IMPLS[1:]:
            raise ValueError(f"attention backend impl {self.impl!r} not in {ATTENTION_IMPLS[1:]}")

    @property
    def uses_kernels(self) -> bool:
        return self.impl != "reference"

    @property
    def interpret(self) -> bool:
        return self.impl == "pallas_interpret"

    def paged_attention(self, q, pages, batch, *, sm_scale=None):
        """q [N, NH, hd] ragged tokens over one layer's pages -> [N, NH, hd_v]: the one
        attention dispatch, for every page kind (see the module docstring)."""
        from mtpjax.model.attention_routes import attention_route
        route = attention_route(pages)
        if not self.uses_kernels:
            return route.reference(q, pages, batch, sm_scale=sm_scale)
        mesh_layer = None
        reason = None
        if self.mesh is not None and self.mesh.size > 1:
            mesh_layer = _registered_mesh_layer(self.mesh)
            reason = mesh_layer.unsupported_reason(q.shape[1], route.num_kv_heads(pages),
                                                   self.mesh)
        if reason is None:
            reason = route.unsupported_reason(q, pages, batch, interpret=self.interpret)
        if reason is not None:
            if not self.fallback:                   # an explicit "pallas": say why not
                raise ValueError(f"the Pallas attention kernels do not support {reason}; use "
                                 "attention_impl='auto' (falls back to the reference) or "
                                 "'reference'")
            if reason not in _warned:               # "auto": the reference (XLA partitions it)
                _warned.add(reason)
                warnings.warn(f"Pallas attention does not support {reason}; using the reference")
            return route.reference(q, pages, batch, sm_scale=sm_scale)
        kernel = functools.partial(route.kernel, sm_scale=sm_scale, interpret=self.interpret)
        if mesh_layer is not None:
            return mesh_layer.per_device(kernel, q, pages, batch,
                                         num_kv_heads=route.num_kv_heads(pages), mesh=self.mesh)
        return kernel(q, pages, batch)


def resolve_backend(impl: "str | AttentionBackend" = "auto", mesh=None) -> AttentionBackend:
    """An AttentionBackend from a name ("auto" | "reference" | "pallas" | "pallas_interpret"),
    carrying `mesh` (a ("data", "model") jax.sharding.Mesh, or None)."""
    if mesh is not None:
        return dataclasses.replace(resolve_backend(impl), mesh=mesh)
    if isinstance(impl, AttentionBackend):
        return impl
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention impl {impl!r} not in {ATTENTION_IMPLS}")
    if impl != "auto":
        return AttentionBackend(impl)
    env = os.environ.get("MTPJAX_ATTENTION_IMPL")
    if env:
        if env not in ATTENTION_IMPLS[1:]:
            raise ValueError(f"MTPJAX_ATTENTION_IMPL={env!r}; expected one of {ATTENTION_IMPLS[1:]}")
        return AttentionBackend(env)
    if jax.default_backend() == "gpu":
        return AttentionBackend("pallas", fallback=True)
    return AttentionBackend("reference")
