"""`python -m mtpjax.bench.all_reduce` on two fake CPU devices: the tensor-parallel MLP stack
it times equals one device's stack on random weights (so the psum it measures is the real
reduction), its program holds one all-reduce per layer in the dtype asked, and the bench prints
its table last. A subprocess: XLA_FLAGS (the device count) is read once per process."""

import json
import os
import subprocess
import sys

SCRIPT = r'''
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from mtpjax.bench import all_reduce as ar
from mtpjax.parallel.mesh import make_mesh
out = {"devices": len(jax.devices()), "errors": []}
mesh = make_mesh(tensor_parallel=2)
for seed in range(3):
    rng = np.random.default_rng(seed)
    L, T, E, F = 2, int(rng.integers(1, 4)), 32, 64
    x = jnp.asarray(rng.standard_normal((T, E)) * 0.5, jnp.float32)
    wu = jnp.asarray(rng.standard_normal((L, E, F)) * E ** -0.5, jnp.float32)
    wd = jnp.asarray(rng.standard_normal((L, F, E)) * F ** -0.5, jnp.float32)
    want = ar.mlp_stack(x, wu, wd, reduce=False, reduce_dtype=jnp.float32)
    args = [jax.device_put(a, NamedSharding(mesh, s))
            for a, s in zip((x, wu, wd), (P(), ar.SPEC_UP, ar.SPEC_DOWN))]
    got = ar.build(mesh, reduce=True, reduce_dtype=jnp.float32)(*args)
    out["errors"].append(float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))))
    part = ar.build(mesh, reduce=False, reduce_dtype=jnp.float32)(*args)   # [2, T, E]
    # without the psum each device holds a partial sum of the first layer's MLP output
    out.setdefault("partial_shapes", []).append(list(part.shape))
rows = ar.main(["--tensor-parallel", "2", "--tokens", "1,3", "--layers", "2", "--hidden",
                "64", "--ffn", "128", "--repeats", "2", "--out", sys.argv[1]])
out["forms"] = [r["form"] for r in rows]
print("RESULT " + json.dumps(out))
'''


def test_all_reduce_bench_on_two_devices(tmp_path):
    env = dict(os.environ)
    flags = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count"))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=2".strip()
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    res = json.loads(next(l for l in lines if l.startswith("RESULT "))[7:])
    assert res["devices"] == 2
    assert max(res["errors"]) < 1e-5, res["errors"]
    assert all(s[0] == 2 for s in res["partial_shapes"])
    assert res["forms"] == ["one device", "TP=2, no psum", "TP=2, psum float32",
                            "TP=2, psum bfloat16"] * 2
    table = [l for l in lines if l.startswith("|")]
    assert table[0].startswith("| tokens | program") and table[-1].startswith("| 3 | TP=2, psum")
    assert lines[-2] == table[-1]                          # the table is last (then RESULT)
    for dtype in ("float32", "bfloat16"):
        hlo = (tmp_path / f"all_reduce_{dtype}.hlo").read_text()
        reduces = [l for l in hlo.splitlines() if " all-reduce(" in l or "all-reduce-start(" in l]
        assert len(reduces) == 2, reduces                  # one per layer
        # of one token's [1, E] (XLA:CPU widens a bf16 all-reduce to f32; XLA:GPU keeps it)
        assert all("f32[1,64]" in l or "bf16[1,64]" in l for l in reduces), reduces
