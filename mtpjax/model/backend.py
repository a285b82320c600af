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
`shard_map` (`parallel/kernels.py`).
"""

from __future__ import annotations

import dataclasses
import os

import jax

ATTENTION_IMPLS = ("auto", "reference", "pallas", "pallas_interpret")


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    impl: str = "reference"        # "reference" | "pallas" | "pallas_interpret"
    fallback: bool = False         # chosen by "auto": unsupported shapes use the reference
    mesh: object = None            # jax.sharding.Mesh ("data", "model") or None

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
        """q [N, NH, hd] ragged tokens over one layer's pages -> [N, NH, hd_v].

        One dispatch for every cache kind: the pages say how they read as K and V pages
        (`kv_views`: GQA pages as they are, MLA latent pages as one shared head whose values are
        the first kv_lora_rank entries), and the shapes pick the path."""
        from mtpjax.model.attention import paged_attention_reference
        k_pages, v_pages = pages.kv_views()
        if not self.uses_kernels:
            return paged_attention_reference(q, k_pages, v_pages, batch, sm_scale=sm_scale)
        from mtpjax.model import pallas_dispatch
        if self.mesh is not None and self.mesh.size > 1:
            from mtpjax.parallel.kernels import per_device_paged_attention
            return per_device_paged_attention(self, q, k_pages, v_pages, batch, sm_scale=sm_scale)
        return pallas_dispatch.paged_attention(q, k_pages, v_pages, batch, sm_scale=sm_scale,
                                               interpret=self.interpret, fallback=self.fallback)


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
