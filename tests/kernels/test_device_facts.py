"""The kernels' device facts: the SM count comes from the device, with the H100 / H200 count
as the fallback off a GPU, so CPU (interpret) runs tune exactly as the GPUs measured."""
import types

import jax

from pallas_kernels._device import FALLBACK_NUM_SMS, num_sms


def test_num_sms_is_a_positive_int_on_this_machine():
    count = num_sms()
    assert isinstance(count, int) and count > 0
    if jax.devices()[0].platform != "gpu":
        assert count == FALLBACK_NUM_SMS == 132


def test_num_sms_reads_a_gpu_core_count_and_falls_back_without_one():
    for sms in (1, 78, 114, 132, 144):
        assert num_sms(types.SimpleNamespace(platform="gpu", core_count=sms)) == sms
    for missing in (None, 0, -1, "132"):
        gpu = types.SimpleNamespace(platform="gpu", core_count=missing)
        assert num_sms(gpu) == FALLBACK_NUM_SMS
    # A non-GPU device's core_count (a CPU's cores) is not an SM count.
    assert num_sms(types.SimpleNamespace(platform="cpu", core_count=16)) == FALLBACK_NUM_SMS
    assert num_sms(jax.devices("cpu")[0]) == FALLBACK_NUM_SMS


def test_default_grids_scale_with_the_sm_count(monkeypatch):
    """The tuning defaults follow the device: fewer SMs, fewer KV splits / programs; at 132
    they are what the H100 / H200 ran."""
    import importlib
    from pallas_kernels import _device
    # the packages re-export functions under their modules' names: import the modules
    grouped_matmul = importlib.import_module("pallas_kernels.grouped_matmul.grouped_matmul")
    fused_ffn = importlib.import_module("pallas_kernels.grouped_matmul.fused_ffn")
    pa = importlib.import_module("pallas_kernels.paged_attention.paged_attention")
    assert grouped_matmul.target_programs() == 264 and fused_ffn.target_programs() == 128
    assert fused_ffn.default_blocks(6, 2048, 1408)[0] == 64       # V2-Lite: 132 programs
    h100_splits = pa._default_num_splits(1, 8, 256, 1)
    for module in (grouped_matmul, fused_ffn, pa):
        monkeypatch.setattr(module, "num_sms", lambda: 16)
    assert grouped_matmul.target_programs() == 32 and fused_ffn.target_programs() == 16
    assert fused_ffn.default_blocks(6, 2048, 1408)[0] == 128      # 66 programs already >= 16
    assert pa._default_num_splits(1, 8, 256, 1) < h100_splits
    assert _device.num_sms() == FALLBACK_NUM_SMS                    # the module itself untouched
