"""bench.mla_profile's trace summary (the profile itself needs a GPU) and its refusals."""
import numpy as np
import pytest

from mtpjax.bench import mla_profile


def _trace(rng, ctas, blocks):
    """Perfetto events as Mosaic's profiler writes them (ts in thousands of cycles), for
    `ctas` CTAs of three warpgroups: wg 0 logits / softmax per block, wg 1 wait_p, the
    memory warpgroup wait_slot and load; plus one "Init" on wg 0. Returns (events, the
    per-block samples expected for blocks 3 .. n-1)."""
    events, want = [], {"period": [], "logits": [], "softmax": [], "rest": []}
    ev = lambda name, ph, t, tid: events.append(dict(name=name, ph=ph, ts=t / 1e3, tid=tid))
    for c in range(ctas):
        tid0 = 1 + 3 * c
        t = float(rng.integers(100, 10_000))
        ev("Init", "B", t - 50, tid0)
        ev("Init", "E", t - 45, tid0)
        starts = []
        for k in range(blocks):
            lg, sm, rest = (float(x) for x in rng.integers([900, 300, 500], [2000, 700, 1200]))
            starts.append(t)
            ev("logits", "B", t, tid0)
            ev("logits", "E", t + lg - 3, tid0)      # the region closes before softmax opens
            ev("softmax", "B", t + lg, tid0)
            ev("softmax", "E", t + lg + sm, tid0)
            if 2 <= k < blocks - 1:
                want["logits"].append(lg)
                want["softmax"].append(sm)
                want["rest"].append(rest)
                want["period"].append(lg + sm + rest)
            t += lg + sm + rest
        for k, s in enumerate(starts):                 # wg 1 and the memory warpgroup
            ev("wait_p", "B", s, tid0 + 1)
            ev("wait_p", "E", s + 100 + k, tid0 + 1)
            ev("wait_slot", "B", s, tid0 + 2)
            ev("wait_slot", "E", s + 7, tid0 + 2)
            ev("load", "B", s + 7, tid0 + 2)
            ev("load", "E", s + 1500 + 10 * k, tid0 + 2)
    return events, want


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_summary_phases_are_wg0s_steady_blocks(seed):
    rng = np.random.default_rng(seed)
    ctas, blocks = int(rng.integers(2, 6)), int(rng.integers(5, 9))
    events, want = _trace(rng, ctas, blocks)
    rng.shuffle(events)          # the summary groups by CTA / warpgroup itself...
    events.sort(key=lambda e: (e["tid"], e["ts"], e["ph"] == "B"))   # ...in time order
    got = mla_profile.summarize(events)
    assert got["blocks"] == ctas * (blocks - 3)
    for name, samples in want.items():
        assert got["phases"][name] == pytest.approx(np.median(samples), abs=1e-6), name
    assert got["regions"]["load"] == pytest.approx(
        np.median([1493 + 10 * k for k in range(blocks)]), abs=1e-6)
    assert got["regions"]["wait_slot"] == pytest.approx(7, abs=1e-6)


def test_unbalanced_regions_and_too_long_a_context_are_refused():
    bad = [dict(name="logits", ph="B", ts=0.0, tid=1), dict(name="softmax", ph="E", ts=1.0,
                                                           tid=1)]
    with pytest.raises(ValueError, match="logits closed by softmax"):
        mla_profile.summarize(bad)
    with pytest.raises(ValueError, match="16 KV blocks of 64, which need --events >= 34"):
        mla_profile.run_case("v128", 1024, 64, 19, "/nonexistent")


def test_the_kernel_profiles_only_compiled():
    import jax.numpy as jnp
    from pallas_kernels.mla_paged_attention.kernel_mgpu import mla_tiles_mgpu
    q = jnp.zeros((2, 64, 576), jnp.bfloat16)
    lat = jnp.zeros((4, 64, 576), jnp.bfloat16)
    bt = jnp.zeros((2, 2), jnp.int32)
    t = jnp.zeros((2,), jnp.int32)
    for profile, interpret in ((("/tmp/x", 19), True), (("/tmp/x",), False),
                               (("/tmp/x", 0), False), ("/tmp/x", False)):
        with pytest.raises(ValueError, match="profile must be None or"):
            mla_tiles_mgpu(q, lat, bt, t, t, t, rank=512, block_h=64, sm_scale=0.1,
                           interpret=interpret, profile=profile)
