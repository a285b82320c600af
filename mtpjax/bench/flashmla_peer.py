"""FlashMLA's Hopper dense decode kernel as a same-run peer of `bench mla` (`--flashmla DIR`).

FlashMLA (deepseek-ai/FlashMLA, MIT) is the MLA kernel DeepSeek serves with; its deep dive
(docs/20250422-new-kernel-deep-dive.md) reports ~660 TFLOP/s on an H800, which is the state
of the art the MLA verify target is measured against. It is CUDA C++ and ships no wheel
for this machine, so this module builds its SM90 dense decode kernel from a source checkout
on the GPU machine (torch's C++ extension loader, nvcc, sm_90a) and times it on the very
arrays `bench mla` times its own kernel on.

    DIR = a FlashMLA checkout whose csrc/ holds api/, sm90/, smxx/, kerutils/ and the CUTLASS
          submodule (csrc/cutlass/include); nothing of it is part of this repository.

Only the binding below is ours: it exposes FlashMLA's own `dense_attn_decode_interface`
(`csrc/api/dense_decode.h`), the function its Python `flash_mla_with_kvcache` calls for a
bf16 paged cache. The scheduler metadata is computed by the first call and reused, as a
serving engine reuses it across layers; each timed call then runs FlashMLA's split-KV
kernel and its combine kernel.

Layouts (uniform batches only: b requests of q_len tokens each, page 64, the only page size
FlashMLA's dense kernel takes):
    ours      q [b * q_len, H, 576], latent [P, 64, 576], block tables [b, M], kv_lens [b]
    FlashMLA  q [b, q_len, H, 576], k_cache [P, 64, 1, 576], the same tables and lengths;
              out [b, q_len, H, 512]. Causal inside a request's q_len tokens, as ours.
"""
from __future__ import annotations

import os

BINDING = """\
// mtpjax's binding of FlashMLA's SM90 dense decode entry point (one function).
#include <pybind11/pybind11.h>
#include "api/dense_decode.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("dense_decode_fwd", &dense_attn_decode_interface);
}
"""

# FlashMLA's own sources for the dense decode path (relative to csrc/).
SOURCES = ("smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu",
           "smxx/decode/combine/combine.cu",
           "sm90/decode/dense/instantiations/bf16.cu")
NEEDED = SOURCES + ("api/dense_decode.h", "cutlass/include/cute/tensor.hpp",
                    "kerutils/include")
PAGE = 64


def check_source(src_dir: str) -> str:
    """The checkout's csrc/ directory, or a ValueError naming the first missing piece."""
    csrc = os.path.join(src_dir, "csrc")
    for rel in NEEDED:
        if not os.path.exists(os.path.join(csrc, rel)):
            raise ValueError(f"--flashmla {src_dir!r}: {os.path.join('csrc', rel)} is missing "
                             f"(expected a deepseek-ai/FlashMLA checkout with its CUTLASS "
                             f"submodule at csrc/cutlass)")
    return csrc


def build(src_dir: str, build_dir: str, verbose: bool = False):
    """Compiles FlashMLA's dense decode kernel and our binding for sm_90a; returns the
    extension module (`dense_decode_fwd`). Minutes on first build (nvcc, CUTLASS)."""
    csrc = check_source(src_dir)
    from torch.utils import cpp_extension
    os.makedirs(build_dir, exist_ok=True)
    binding = os.path.join(build_dir, "mtpjax_flashmla_binding.cpp")
    with open(binding, "w") as f:
        f.write(BINDING)
    # FLASH_MLA_DISABLE_FP16: only the bf16 instantiation is compiled.
    common = ["-O3", "-std=c++20", "-DNDEBUG", "-D_USE_MATH_DEFINES",
              "-DFLASH_MLA_DISABLE_FP16", "-Wno-deprecated-declarations"]
    nvcc = common + ["-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                     "-U__CUDA_NO_HALF2_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
                     "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math",
                     # an explicit target: torch then adds none (a plain sm_90 pass rejects
                     # wgmma and setmaxnreg)
                     "-gencode=arch=compute_90a,code=sm_90a"]
    includes = [csrc, os.path.join(csrc, "kerutils", "include"), os.path.join(csrc, "sm90"),
                os.path.join(csrc, "cutlass", "include"),
                os.path.join(csrc, "cutlass", "tools", "util", "include")]
    # CUDA 13 keeps libcu++ (cuda/std/...) under include/cccl, which nvcc adds for .cu files
    # and the host compiler does not: the binding's .cpp includes CUTLASS headers too.
    cccl = os.path.join(cpp_extension.CUDA_HOME or "/usr/local/cuda", "include", "cccl")
    if os.path.isdir(cccl):
        includes.append(cccl)
    return cpp_extension.load(
        name="mtpjax_flashmla", sources=[binding] + [os.path.join(csrc, s) for s in SOURCES],
        extra_include_paths=includes,
        extra_cflags=common, extra_cuda_cflags=nvcc, build_directory=build_dir,
        verbose=verbose)


def flashmla_queries(q, q_len: int):
    """Our uniform batch's queries [b * q_len, H, W] -> FlashMLA's [b, q_len, H, W] (a
    reshape)."""
    t, h, w = q.shape
    if q_len < 1 or t % q_len:
        raise ValueError(f"q has {t} tokens, not a whole number of rows of q_len {q_len}")
    return q.reshape(t // q_len, q_len, h, w)


def flashmla_pages(latent):
    """Our latent pages [P, 64, W] -> FlashMLA's k_cache [P, 64, 1, W] (a reshape)."""
    if latent.shape[1] != PAGE:
        raise ValueError(f"FlashMLA's dense kernel takes pages of {PAGE} tokens, got "
                         f"{latent.shape[1]}")
    return latent.reshape(latent.shape[0], PAGE, 1, latent.shape[2])


class Peer:
    """FlashMLA on one case's arrays (JAX arrays on the GPU, shared through DLPack, not
    copied). __call__(i) runs it on the i-th query set and returns out [b * q_len, H, 512]
    (a torch tensor); gpu_us(n) times n back-to-back calls with CUDA events."""

    def __init__(self, module, qs, latent, block_tables, kv_lens, *, q_len, rank, sm_scale):
        import torch
        import torch.utils.dlpack as tdl
        to_t = lambda x: tdl.from_dlpack(x)      # noqa: E731
        self.torch, self.mod, self.rank, self.q_len = torch, module, rank, q_len
        self.qs = [to_t(flashmla_queries(q, q_len)).contiguous() for q in qs]
        self.k = to_t(flashmla_pages(latent)).contiguous()     # once: ~300 MB at B=64
        self.bt = to_t(block_tables).contiguous()
        self.lens = to_t(kv_lens).contiguous()
        self.scale = float(sm_scale)
        self.meta = self.splits = None
        self(0)         # computes the scheduler metadata once

    def __call__(self, i: int):
        out, _lse, self.meta, self.splits = self.mod.dense_decode_fwd(
            self.qs[i], self.k, self.rank, self.lens, self.bt, self.scale, self.q_len > 1,
            self.meta, self.splits)
        b, s, h, r = out.shape
        return out.reshape(b * s, h, r)

    def gpu_us(self, calls: int = 32, runs: int = 3) -> float:
        """Median over `runs` of the CUDA-event time of `calls` back-to-back calls, per call."""
        torch = self.torch
        for i in range(3):
            self(i % len(self.qs))
        times = []
        for _ in range(runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(calls):
                self(i % len(self.qs))
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / calls)
        return sorted(times)[len(times) // 2]
