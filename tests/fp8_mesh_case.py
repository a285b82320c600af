"""FP8 params on meshes of fake CPU devices (run by tests/model/test_fp8_weights.py in a subprocess:
XLA_FLAGS sets the device count at jax import). Prints RESULT <json>."""

import json
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import mtpjax
from mtpjax import Fp8Weight, quantize_fp8
from mtpjax.checkpoint import export_hf, load_hf, orbax_io
from mtpjax.model.moe import MOE
from mtpjax.parallel import shard_params
from tests.model.test_deepseek import _ds_params, ds_config


def main() -> dict:
    cfg = ds_config(num_mtp_layers=1)
    params = quantize_fp8(_ds_params(cfg, 5), (16, 16))            # float32 stand-ins
    x = jax.random.normal(jax.random.PRNGKey(1), (7, cfg.hidden_size))
    valid = np.arange(7) < 6
    ref_layer = np.asarray(MOE(params["layers"][1], x, cfg, valid))
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    ref_tokens = mtpjax.generate(params, cfg, prompts, max_new_tokens=6).tokens
    out = {"layer_scale": float(np.abs(ref_layer).max())}
    with tempfile.TemporaryDirectory() as tmp:
        export_hf(tmp + "/q", params, cfg)
        orbax_io.save(tmp + "/o", params, cfg)
        for d, m in ((1, 4), (2, 2)):
            mesh = mtpjax.make_mesh(tensor_parallel=m, data_parallel=d)
            ps = shard_params(params, cfg, mesh)
            f = jax.jit(lambda p, x, v, mesh=mesh: MOE(p, x, cfg, v, mesh))
            layer = np.asarray(f(ps["layers"][1], x, valid))
            loaded = load_hf(tmp + "/q", mesh=mesh, dtype=jnp.float32).params
            restored = orbax_io.restore(tmp + "/o", mesh=mesh).params

            def same_as_placed(tree):
                return jax.tree.structure(tree) == jax.tree.structure(ps) and all(
                    np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
                    and a.sharding == b.sharding
                    for a, b in zip(jax.tree.leaves(ps), jax.tree.leaves(tree)))
            specs = {k: [str(w.values.sharding.spec), str(w.scale.sharding.spec)]
                     for k, w in (("w_gate", ps["layers"][1]["w_gate"]),
                                  ("shared_gate", ps["layers"][1]["shared_gate"]),
                                  ("wq_b", ps["layers"][1]["wq_b"]),
                                  ("wkv_b", ps["layers"][1]["wkv_b"]))}
            r = {"layer_err": float(np.abs(layer - ref_layer).max()),
                 "loaded_equal": same_as_placed(loaded),
                 "restored_equal": same_as_placed(restored),
                 "specs": specs, "fp8": isinstance(loaded["layers"][1]["w_gate"], Fp8Weight)}
            if (d, m) == (1, 4):
                r["tokens_equal"] = mtpjax.generate(ps, cfg, prompts, max_new_tokens=6,
                                                    mesh=mesh).tokens == ref_tokens
            out[f"{d}x{m}"] = r
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main()))
    sys.stdout.flush()
