"""`python -m mtpjax.bench.fp8_xla` (CPU, tiny shapes): XLA's two FP8 forms equal the
dequantized reference on random weights and scales, and the bench prints its table last."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtpjax.bench import fp8_xla


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_xla_fp8_forms_equal_the_dequantized_reference(seed):
    rng = np.random.default_rng(seed)
    T, K, N = int(rng.integers(1, 5)), 256, 384
    x = jnp.asarray(rng.normal(size=(T, K)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(K, N)) * 0.1, jnp.float32).astype(jnp.float8_e4m3fn)
    s_col = jnp.asarray(rng.uniform(0.5, 2.0, N), jnp.float32)
    s_blk = jnp.asarray(rng.uniform(0.5, 2.0, (K // 128, N // 128)), jnp.float32)
    for form, s in ((fp8_xla.per_channel, s_col), (fp8_xla.block_batched, s_blk)):
        got = np.asarray(form(x, w, s))
        want = np.asarray(fp8_xla.dequantized(x, w, s))
        # the forms scale after an exact product of bf16 x and the e4m3 values (both exact in
        # float32); the reference rounds each value x scale to bf16 first: 2^-8 relative
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, atol=2e-2 * scale, rtol=0)


def test_bench_prints_its_table_last(capsys, tmp_path):
    rows = fp8_xla.main(["--shapes", "256x384", "--tokens", "1,2", "--chain", "2",
                         "--copy-mib", "1", "--out", str(tmp_path)])
    assert len(rows) == 2 and all(r["block_batched_us"] > 0 for r in rows)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-4].startswith("| K x N") and lines[-1].startswith("| 256 x 384 | 2 |")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["block_batched_256x384_t1.hlo",
                                                         "per_channel_256x384_t1.hlo"]
    with pytest.raises(SystemExit):
        fp8_xla.main(["--shapes", "100x384"])
