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


def test_flashmla_peer_layout_and_refusals(tmp_path):
    """FlashMLA's peer (GPU only) maps our uniform batch onto its shapes token for token, and
    refuses a checkout without its sources, a page other than 64 and a ragged token count."""
    import numpy as np
    from mtpjax.bench import flashmla_peer
    rng = np.random.default_rng(0)
    for b, q_len, h in ((3, 4, 2), (5, 1, 3)):
        q = rng.standard_normal((b * q_len, h, 8)).astype(np.float32)
        lat = rng.standard_normal((7, 64, 8)).astype(np.float32)
        fq, fk = flashmla_peer.flashmla_queries(q, q_len), flashmla_peer.flashmla_pages(lat)
        assert fq.shape == (b, q_len, h, 8) and fk.shape == (7, 64, 1, 8)
        r, j = rng.integers(b), rng.integers(q_len)
        np.testing.assert_array_equal(fq[r, j], q[r * q_len + j])     # request r, token j
        np.testing.assert_array_equal(fk[:, :, 0], lat)
    with pytest.raises(ValueError, match="pages of 64 tokens, got 16"):
        flashmla_peer.flashmla_pages(lat[:, :16])
    with pytest.raises(ValueError, match="q has 5 tokens, not a whole number of rows of q_len 4"):
        flashmla_peer.flashmla_queries(q, 4)
    (tmp_path / "csrc").mkdir()
    with pytest.raises(ValueError, match=r"csrc/smxx/decode/get_decoding_sched_meta.* is missing"):
        flashmla_peer.check_source(str(tmp_path))
    # bench mla refuses a bad checkout before it measures anything
    with pytest.raises(ValueError, match="is missing"):
        mla.main(["--flashmla", str(tmp_path / "nowhere"), "--out", str(tmp_path)])
