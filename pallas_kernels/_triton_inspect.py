"""What a Pallas-Triton kernel compiles to on an H100 / H200, seen from a machine with no GPU.

`triton_modules(fn, *avals)` lowers `fn` for CUDA and returns the Triton IR (TTIR) text of each
pallas_call in it; `compile_for_sm90(ttir)` runs that TTIR through the `triton` package's own
compiler for sm_90a (Triton ships ptxas), giving the TTGIR (layouts, software pipelining), PTX
and cubin. `sass(cubin)` disassembles with the nvdisasm Triton ships. XLA compiles the same TTIR
with the Triton it bundles, whose passes may differ by a version: read these as evidence of what
the kernel asks for (vector widths, shared-memory round trips, barriers), not as the exact code.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

import jax


def triton_modules(fn, *avals) -> list[str]:
    """TTIR text of every pallas_call in jit(fn) lowered for CUDA at `avals`."""
    from jax import export
    from jax._src.pallas.triton import pallas_call_registration as registration
    lower = registration.lowering.lower_jaxpr_to_triton_module
    modules = []

    def lower_and_keep(*a, **k):
        result = lower(*a, **k)
        result.module.operation.verify()
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    registration.lowering.lower_jaxpr_to_triton_module = lower_and_keep
    try:
        export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
            export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*avals)
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower
    return modules


def compile_for_sm90(ttir: str, num_warps: int, num_stages: int) -> dict:
    """{"ttgir", "ptx", "cubin", "shared"} of the TTIR compiled by the `triton` package."""
    import triton
    from triton.backends.compiler import GPUTarget
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")     # silences 3.9's notice
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ttir")
        with open(path, "w") as f:
            f.write(ttir)
        k = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": num_warps, "num_stages": num_stages})
    return dict(ttgir=k.asm["ttgir"], ptx=k.asm["ptx"], cubin=k.asm["cubin"],
                shared=k.metadata.shared)


def sass(cubin: bytes) -> str:
    """The cubin's SASS, one instruction a line, without addresses or encodings."""
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-c", f.name], check=True, capture_output=True,
                              text=True).stdout
    lines = (re.sub(r"/\*[^*]*\*/", "", line).strip() for line in text.splitlines())
    return "\n".join(line for line in lines if line)


def loop_opcodes(sass_text: str) -> dict[str, int]:
    """Opcode counts (without modifiers or predicates) of the first loop: from the first
    label to the first backward branch."""
    lines = sass_text.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\.L_x_\d+:", line))
    end = next(i for i in range(start, len(lines)) if " BRA " in f" {lines[i]}")
    counts: dict[str, int] = {}
    for line in lines[start + 1:end + 1]:
        m = re.match(r"(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)", line)
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts
