"""Registers, spills and matrix instructions of the Pallas kernels on an H100, without a GPU.

    python -m mtpjax.bench.register_report --triton-python PY [--cases a,b] [--configs 8/2,4/1]

1. On this machine, each case (a kernel, its shapes and tuning) is lowered for CUDA
   (`jax.export(..., platforms=["cuda"])`) and the Triton IR of its Pallas call is kept.
2. In the Python `PY`, which must have the `triton` wheel (kept apart from the project's
   environment: `python3 -m venv /tmp/tv && /tmp/tv/bin/pip install triton==3.5.0`), that IR is
   compiled for sm_90 at each num_warps/num_stages, and the wheel's `ptxas -v` reports the
   registers per thread and the spill bytes; the PTX is searched for `wgmma.mma_async` (Hopper
   warpgroup MMA) and `mma.sync` (the older per-warp MMA).

A proxy: XLA compiles the same IR with its own Triton pin, so numbers can differ, but what this
found first (e.g. the MLA kernel's 64-row tiles use wgmma and spill 1.2-1.5 KB
per thread at 255 registers; the grouped matmul's 128 x 128 tiles spill at 4 warps and not at 8)
is where the GPU time goes next. Without `--triton-python` only step 1 runs (the IR files).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile

CASES = {
    # name: (kernel, arguments as (shape, dtype name), tuning)
    "gmm_prefill": ("grouped_matmul", [((24576, 2048), "bfloat16"), ((64, 2048, 1408), "bfloat16"),
                                       ((64,), "int32")],
                    dict(block_m=128, block_n=128, block_k=64, num_splits=1)),
    "gmm_decode": ("grouped_matmul", [((6, 2048), "bfloat16"), ((64, 2048, 1408), "bfloat16"),
                                      ((64,), "int32")], {}),
    # the routed experts' SwiGLU (V2-Lite): gate + up in one kernel (two accumulators), then down;
    # prefill tiles of 128 rows (the default halves gate/up's column blocks to 64) and decode
    "swiglu_prefill": ("grouped_swiglu", [((24576, 2048), "bfloat16"),
                                          ((64, 2048, 1408), "bfloat16"),
                                          ((64, 2048, 1408), "bfloat16"),
                                          ((64, 1408, 2048), "bfloat16"), ((64,), "int32")],
                       dict(block_m=128, gate_up_blocks=(None, 64, 1, None),
                            down_blocks=(128, 64, 1, None))),
    "swiglu_decode": ("grouped_swiglu", [((6, 2048), "bfloat16"), ((64, 2048, 1408), "bfloat16"),
                                         ((64, 2048, 1408), "bfloat16"),
                                         ((64, 1408, 2048), "bfloat16"), ((64,), "int32")], {}),
    "mla_decode_h16": ("mla", [((64, 16, 576), "bfloat16")], {}),
    "mla_decode_h128": ("mla", [((64, 128, 576), "bfloat16")], {}),
    "mla_verify_h16": ("mla", [((256, 16, 576), "bfloat16")], dict(block_q=4)),
    "mla_decode_h128_vs2_qc128": ("mla", [((64, 128, 576), "bfloat16")],
                                  dict(value_split=2, qk_chunk=128)),
    "mla_verify_h16_vs2_qc128": ("mla", [((256, 16, 576), "bfloat16")],
                                 dict(block_q=4, value_split=2, qk_chunk=128)),
    "mla_decode_h128_vs2_qc128_bk32": ("mla", [((64, 128, 576), "bfloat16")],
                                       dict(value_split=2, qk_chunk=128, block_k=32)),
    "mla_verify_h16_vs2_qc128_bk32": ("mla", [((256, 16, 576), "bfloat16")],
                                      dict(block_q=4, value_split=2, qk_chunk=128, block_k=32)),
    # 32-row tiles at H=128 (4 head tiles per sequence, 4 warps): can two CTAs share an SM?
    "mla_decode_h128_qc256": ("mla", [((64, 128, 576), "bfloat16")], dict(qk_chunk=256)),
    "mla_decode_h128_qc128": ("mla", [((64, 128, 576), "bfloat16")], dict(qk_chunk=128)),
    "mla_decode_h128_kf": ("mla", [((64, 128, 576), "bfloat16")], dict(keys_first=True)),
    "mla_decode_h128_kf_bk32": ("mla", [((64, 128, 576), "bfloat16")],
                                dict(keys_first=True, block_k=32)),
    "mla_verify_h16_kf": ("mla", [((256, 16, 576), "bfloat16")],
                          dict(block_q=4, keys_first=True)),
    "mla_decode_h128_bh32": ("mla", [((64, 128, 576), "bfloat16")],
                             dict(block_h=32, num_warps=4, num_stages=2)),
    "mla_decode_h128_bh32_bk32": ("mla", [((64, 128, 576), "bfloat16")],
                                  dict(block_h=32, block_k=32, num_warps=4, num_stages=2)),
    "mla_decode_h16_vs2": ("mla", [((64, 16, 576), "bfloat16")], dict(value_split=2)),
    "mla_decode_h16_vs2_qc128": ("mla", [((64, 16, 576), "bfloat16")],
                                 dict(value_split=2, qk_chunk=128)),
    "mla_decode_h16_vs4_qc128": ("mla", [((64, 16, 576), "bfloat16")],
                                 dict(value_split=4, qk_chunk=128)),
    # GQA paged attention at the Llama-3-8B layer shape (32 heads over 8 KV heads, d 128,
    # page 16): decode at batch 1 and verify (q_len 4) at batch 32
    "paged_decode_b1": ("paged", [((1, 1, 32, 128), "bfloat16")], {}),
    "paged_verify_b32_q4": ("paged", [((32, 4, 32, 128), "bfloat16")], {}),
    # the engine's mixed step: 512 tokens over 8 sequences (prefill chunks + decode rows)
    "ragged_mixed_512": ("ragged", [((512, 32, 128), "bfloat16")], {}),
}

# Runs in the Python that has `triton`: argv = jobs.json, prints one JSON result per job.
_WORKER = r'''
import json, os, re, subprocess, sys, tempfile
import triton
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
target = GPUTarget("cuda", 90, 32)


def optimized_ttir(path, d):
    """The TTIR passes a compile from Python source runs (make_ttir: canonicalize, combine
    (e.g. `acc * a + dot(p, v)` into dot's accumulator), CSE, ...): triton.compile of a .ttir
    file starts after them, and XLA runs its own equivalents on a Pallas kernel."""
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend = CUDABackend(target)
    backend.load_dialects(ctx)
    mod = ir.parse_mlir_module(path, ctx)
    mod.context = ctx
    mod = backend.make_ttir(mod, {}, backend.parse_options({}), 90)
    out = os.path.join(d, "opt.ttir")
    open(out, "w").write(str(mod))
    return out


for job in json.load(open(sys.argv[1])):
    res = dict(job)
    try:
        with tempfile.TemporaryDirectory() as d:
            k = triton.compile(optimized_ttir(job["ir"], d), target=target,
                               options={"num_warps": job["warps"], "num_stages": job["stages"]})
        ptx = k.asm["ptx"]
        res.update(wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
                   mma_sync=len(re.findall(r"mma\.sync", ptx)), shared=k.metadata.shared)
        with tempfile.TemporaryDirectory() as d:
            open(os.path.join(d, "k.ptx"), "w").write(ptx)
            out = subprocess.run([ptxas, "-arch=sm_90a", "-v", os.path.join(d, "k.ptx"), "-o",
                                  os.path.join(d, "k.cubin")], capture_output=True, text=True)
        info = out.stdout + out.stderr
        regs = re.search(r"Used (\d+) registers", info)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
        res.update(registers=int(regs.group(1)) if regs else None,
                   spill_stores=int(spill.group(1)) if spill else None,
                   spill_loads=int(spill.group(2)) if spill else None)
    except Exception as e:  # noqa: BLE001
        res["error"] = repr(e)[:300]
    print(json.dumps(res), flush=True)
'''


H100_REGISTERS = 65536            # per SM
H100_SHARED = 227 * 1024          # bytes per block (opt-in maximum); 228 KB per SM


def ctas_per_sm(registers, warps: int, shared: int) -> int:
    """CTAs of this kernel one H100 SM can hold, by registers (allocated per warp in units of
    256) and shared memory; 0: the block cannot launch (shared memory over the limit)."""
    if shared > H100_SHARED:
        return 0
    per_warp = -(-(registers or 0) * 32 // 256) * 256
    by_regs = H100_REGISTERS // max(per_warp * warps, 1)
    by_shared = (228 * 1024) // max(shared + 1024, 1)      # + 1 KB reserved per CTA
    return min(by_regs, by_shared, 64 // warps)


def lower_to_triton_ir(name: str, out_dir: str) -> list[str]:
    """Lowers case `name` for CUDA; writes and returns the Triton IR file(s) of its Pallas
    call(s)."""
    import jax
    import jax.numpy as jnp
    from jax import export
    from jax._src.pallas.triton import pallas_call_registration as registration

    from pallas_kernels.grouped_matmul import grouped_matmul, grouped_swiglu
    from pallas_kernels.mla_paged_attention import mla_paged_attention
    from pallas_kernels.paged_attention import paged_attention
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    kernel, args, tuning = CASES[name]
    S, i32 = jax.ShapeDtypeStruct, jnp.int32
    if kernel in ("grouped_matmul", "grouped_swiglu"):
        fn = functools.partial(grouped_matmul if kernel == "grouped_matmul" else grouped_swiglu,
                               **tuning)
        specs = [S(s, jnp.dtype(d)) for s, d in args]
    elif kernel == "paged":                 # context up to 4096 tokens in pages of 16
        (q_shape, q_dtype), = args
        b, dt = q_shape[0], jnp.dtype(q_dtype)
        fn = functools.partial(paged_attention, **tuning)
        kv = S((8, b * 256 + 8, 16, 128), dt)
        specs = [S(q_shape, dt), kv, kv, S((b, 256), i32), S((b,), i32)]
    elif kernel == "ragged":                # 8 sequences, context up to 4096 in pages of 16
        (q_shape, q_dtype), = args
        dt = jnp.dtype(q_dtype)
        fn = functools.partial(ragged_paged_attention, **tuning)
        kv = S((8, 8 * 256 + 8, 16, 128), dt)
        specs = [S(q_shape, dt), kv, kv, S((8, 256), i32), S((8,), i32), S((9,), i32),
                 S((1,), i32)]
    else:                                   # MLA: B=64 sequences, context 4096, page 64
        (q_shape, q_dtype), = args
        fn = functools.partial(mla_paged_attention, kv_lora_rank=512, **tuning)
        specs = [S(q_shape, jnp.dtype(q_dtype)), S((4096 + 64, 64, 576), jnp.dtype(q_dtype)),
                 S((64, 64), i32), S((64,), i32), S((65,), i32), S((1,), i32)]
    lower = registration.lowering.lower_jaxpr_to_triton_module
    paths = []

    def keep(*a, **k):
        result = lower(*a, **k)
        path = os.path.join(out_dir, f"{name}_{len(paths)}.ttir")
        with open(path, "w") as f:
            f.write(result.module.operation.get_asm(enable_debug_info=False))
        paths.append(path)
        return result

    registration.lowering.lower_jaxpr_to_triton_module = keep
    try:
        export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
            export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*specs)
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated of {list(CASES)}")
    ap.add_argument("--configs", default="4/1,8/1,8/2",
                    help="num_warps/num_stages, comma-separated")
    ap.add_argument("--triton-python", default=os.environ.get("MTPJAX_TRITON_PYTHON"),
                    help="a Python with the triton wheel (or $MTPJAX_TRITON_PYTHON)")
    ap.add_argument("--out", default=None, help="folder for the IR files and report.json")
    a = ap.parse_args(argv)
    cases = [c for c in a.cases.split(",") if c]
    bad = [c for c in cases if c not in CASES]
    if bad:
        raise SystemExit(f"unknown cases {bad}; expected some of {list(CASES)}")
    configs = [tuple(int(x) for x in c.split("/")) for c in a.configs.split(",") if c]
    out = a.out or tempfile.mkdtemp(prefix="register_report_")
    os.makedirs(out, exist_ok=True)
    jobs = []
    for c in cases:
        paths = lower_to_triton_ir(c, out)
        for k, path in enumerate(paths):        # a case may make several Pallas calls
            name = c if len(paths) == 1 else f"{c} #{k}"
            jobs += [dict(case=name, ir=path, warps=w, stages=s) for w, s in configs]
    print(f"Triton IR of {len(cases)} case(s) in {out}", flush=True)
    if not a.triton_python:
        print("no --triton-python: lowering only (see the module docstring)")
        return 0
    with open(os.path.join(out, "jobs.json"), "w") as f:
        json.dump(jobs, f)
    with open(os.path.join(out, "worker.py"), "w") as f:
        f.write(_WORKER)
    proc = subprocess.run([a.triton_python, os.path.join(out, "worker.py"),
                           os.path.join(out, "jobs.json")], capture_output=True, text=True)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if not results:
        print(proc.stderr[-2000:], file=sys.stderr)
        return 1
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("| case | warps | stages | registers | spill stores B | spill loads B | wgmma | "
          "mma.sync | shared B | CTAs/SM |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['case']} | {r['warps']} | {r['stages']} | error: {r['error']} |")
            continue
        print(f"| {r['case']} | {r['warps']} | {r['stages']} | {r['registers']} | "
              f"{r['spill_stores']} | {r['spill_loads']} | {r['wgmma']} | {r['mma_sync']} | "
              f"{r['shared']} | {ctas_per_sm(r['registers'], r['warps'], r['shared'])} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
