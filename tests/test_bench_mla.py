"""bench.mla's --variants parsing (the benchmark itself needs a GPU)."""

import pytest

from mtpjax.bench import mla


def test_variants_parse_and_join_every_case():
    extra = mla.parse_variants("value_split=2,qk_chunk=128; value_split=4,qk_chunk=None")
    assert extra == [dict(value_split=2, qk_chunk=128), dict(value_split=4, qk_chunk=None)]
    got = mla.variants_for(4, 128, 16, 64, 4096, sweep=False, extra=extra)
    u4 = dict(block_q=4, uniform_q_len=4)
    assert got == [u4, dict(u4, value_split=2, qk_chunk=128),
                   dict(u4, value_split=4, qk_chunk=None)]
    assert mla.parse_variants("") == []
    # text values stay text; every row passes the uniform batch's q_len (as the model's
    # dispatch does), and compact=0 asks for the gather path
    extra = mla.parse_variants("kernel=triton;compact=0")
    u1 = dict(block_q=1, uniform_q_len=1)
    assert mla.variants_for(1, 16, 64, 64, 4096, sweep=False, extra=extra) == [
        u1, dict(u1, kernel="triton"), dict(u1, compact=0)]
    assert mla.variants_for(4, 16, 64, 64, 4096, sweep=True)[1]["kernel"] == "triton"
    with pytest.raises(ValueError, match="'qk_chunk': expected key=value"):
        mla.parse_variants("value_split=2,qk_chunk")


def test_rows_rank_by_gpu_span_when_measured_and_matmul_clock_is_checked():
    wall_only = dict(us=120.0)
    both = dict(us=130.0, gpu_us=110.0)
    assert mla._time(wall_only) == 120.0 and mla._time(both) == 110.0
    assert mla._time(both) < mla._time(wall_only)      # the GPU span ranks, not the wall
    from mtpjax.bench import kernels
    with pytest.raises(ValueError, match="clock must be 'wall' or 'gpu', got 'cpu'"):
        kernels.matmul_rate(64, reps=1, clock="cpu")
    # off the GPU there is no kernel timeline: the wall clock answers
    assert kernels.matmul_rate(64, reps=1, clock="gpu") > 0
