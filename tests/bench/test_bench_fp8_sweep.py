"""`mtpjax bench fp8-linear --sweep`: its rows and its closing table, run interpreted on tiny
shapes (the times mean nothing on a CPU; the table's structure and the variants' names do)."""

import re

from mtpjax.bench import fp8_linear


def _rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")]
            for line in text.splitlines() if re.match(r"\| \d+ x \d+ \|", line)]


def test_sweep_times_every_variant_against_the_bf16_peer(capsys):
    a = fp8_linear.build_parser().parse_args(
        ["--sweep", "--sweep-shapes", "256x128", "--tokens", "1,3", "--sweep-interpret",
         "--sweep-defaults-only"])
    fp8_linear.sweep(a, 1e12)
    text = capsys.readouterr().out
    body, best = text.split("best of each variant:")
    rows, best_rows = _rows(body), _rows(best)
    for M, probe in (("1", {"probe"}), ("3", set())):     # the probe reads at one M only
        labels = {r[2] for r in rows if r[1] == M}
        assert labels == {"bf16", "tiles", "stream", "stream-fma"} | probe, labels
    # defaults only: one row each, but two of stream (f16 and bf16 dots), two probes
    assert len(rows) == 12 and len(best_rows) == 9
    for r in rows:
        us, x_floor = float(r[4]), float(r[5])
        assert us > 0 and x_floor > 0
        if r[2] != "bf16":
            assert r[6].endswith("x")                 # against the peer of its shape and M


def test_stream_configs_vary_one_thing_from_the_defaults():
    for M, fma in ((1, True), (32, False)):
        configs = fp8_linear.stream_configs(M)
        assert all(c["variant"] == "stream" for c in configs)
        assert any(c.get("mode") == "fma" for c in configs) == fma
        names = [fp8_linear._config_name(c) for c in configs]
        assert len(set(names)) == len(names) and "default" not in names


def test_read_probe_reads_every_word_once():
    import jax
    import jax.numpy as jnp
    import numpy as np
    import pytest
    from mtpjax.bench.weight_read_probe import read_probe
    for seed, (splits, prefetch) in enumerate(((1, 1), (2, 2), (4, 1))):
        v = jax.random.normal(jax.random.PRNGKey(seed), (512, 128)).astype(jnp.float8_e4m3fn)
        words = np.asarray(v).view(np.uint32)                    # [512, 32], four bytes a word
        want = words.reshape(splits, 512 // splits, 32).sum(axis=1, dtype=np.uint32)
        got = read_probe(v, block_n=64, splits=splits, prefetch=prefetch, interpret=True)
        assert np.array_equal(np.asarray(got), want), (splits, prefetch)
    with pytest.raises(ValueError, match="splits=3"):
        read_probe(v, splits=3)
