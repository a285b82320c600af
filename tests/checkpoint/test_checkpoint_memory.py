"""Peak host memory of loading a Hugging Face checkpoint stays within the streaming bound:
the output plus the largest tensor (plus 16 MB of interpreter noise). The same measurement of a loader that
reads the whole checkpoint first must exceed the bound, which shows the test can fail."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

safetensors_numpy = pytest.importorskip("safetensors.numpy")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MB = 2 ** 20
SLACK = 16 * MB

# Runs in a fresh interpreter. The kernel's peak-RSS mark (VmHWM) is reset to the current RSS
# just before the load (/proc/self/clear_refs), so import-time peaks do not count.
_SCRIPT = r"""
import json, sys
import jax, numpy as np
path, mode = sys.argv[1], sys.argv[2]
from mtpjax.checkpoint import from_hf_state_dict, load_hf
from mtpjax.checkpoint.hf_load import read_hf_config
from mtpjax.checkpoint.safetensors_io import read_tensor, scan_folder
jax.block_until_ready(jax.device_put(np.ones(1024, np.float32)) + 1)     # warm up the runtime

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
if mode == "stream":
    params = load_hf(path).params
else:                               # the whole checkpoint in memory, then converted
    tensors = {n: read_tensor(i) for n, i in scan_folder(path).items()}
    params = from_hf_state_dict(read_hf_config(path)[1], tensors)
jax.block_until_ready(params)
print(json.dumps({"before": before, "peak": status("VmHWM")}))
"""


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory):
    """~69 MB float32 llama: two 32 MB vocab tensors (embedding, head) and two small layers."""
    V, E, I, L = 32768, 256, 512, 2
    rng = np.random.default_rng(0)
    t = {"model.embed_tokens.weight": rng.standard_normal((V, E), np.float32),
         "lm_head.weight": rng.standard_normal((V, E), np.float32),
         "model.norm.weight": np.ones(E, np.float32)}
    for i in range(L):
        p = f"model.layers.{i}"
        for name, shape in [("input_layernorm", (E,)), ("post_attention_layernorm", (E,)),
                            ("self_attn.q_proj", (E, E)), ("self_attn.k_proj", (E // 2, E)),
                            ("self_attn.v_proj", (E // 2, E)), ("self_attn.o_proj", (E, E)),
                            ("mlp.gate_proj", (I, E)), ("mlp.up_proj", (I, E)),
                            ("mlp.down_proj", (E, I))]:
            t[f"{p}.{name}.weight"] = rng.standard_normal(shape, np.float32)
    path = tmp_path_factory.mktemp("big")
    safetensors_numpy.save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(dict(
        model_type="llama", vocab_size=V, hidden_size=E, intermediate_size=I,
        num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2)))
    total = sum(a.nbytes for a in t.values())
    return path, total, max(a.nbytes for a in t.values())


def _measure(path, mode):
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(path), mode], capture_output=True,
                         text=True, check=True, env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT})
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return r["peak"] - r["before"]


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                    reason="needs Linux /proc/self/clear_refs to reset the peak-RSS mark")
def test_peak_memory_within_streaming_bound(big_checkpoint):
    path, output, largest = big_checkpoint
    bound = output + largest + SLACK
    grew = _measure(path, "stream")
    assert output * 0.9 < grew <= bound, (grew / MB, output / MB, bound / MB)
    # control: holding the whole checkpoint before converting breaks the same bound
    assert _measure(path, "whole") > bound
