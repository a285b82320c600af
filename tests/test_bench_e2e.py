"""`mtpjax bench e2e` end to end on the tiny shape (CPU): every row, finite numbers, the HF peer
skipped, the table last and e2e.json written."""

import json
import math

from mtpjax.cli import main


def test_bench_e2e_tiny_prints_every_row(capsys, tmp_path):
    rc = main(["bench", "e2e", "--model-shape", "tiny", "--batch", "1", "--prompt-len", "4",
               "--new-tokens", "32", "--k", "2", "--copy-mib", "4", "--repeats", "3",
               "--draft-vocab", "16",
               "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    lines = out[out.index("| row |"):].strip().splitlines()
    assert out.rstrip().endswith(lines[-1])                      # the table comes last
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = dict(zip(head, (c.strip() for c in line.strip("|").split("|"))))
        rows[cells["row"]] = cells
    timed = ["generate plain", "generate MTP K=2", "generate MTP K=2 draft vocab 16",
             "engine plain", "engine MTP K=2", "engine MTP K=2 draft vocab 16"]
    assert list(rows) == ["start-up cold (engine MTP K=2)", *timed, "HF Llama static+compile"]
    for name in timed:
        r = rows[name]
        values = [float(r[c]) for c in ("ms/step", "tok/s", "acc len", "floor ms", "% floor")]
        assert all(math.isfinite(v) and v > 0 for v in values), (name, r)
        assert r["batch"] == "1" and 1 <= float(r["acc len"]) <= 3
    assert float(rows["generate plain"]["acc len"]) == 1.0
    for api in ("generate", "engine"):          # the subset's draft passes read fewer bytes
        assert float(rows[f"{api} MTP K=2 draft vocab 16"]["floor ms"]) < float(
            rows[f"{api} MTP K=2"]["floor ms"])
    assert math.isfinite(float(rows["start-up cold (engine MTP K=2)"]["start-up s"]))
    hf = rows["HF Llama static+compile"]
    assert hf["ms/step"] == "" and "JAX runs on the CPU" in hf["note"]
    saved = json.loads((tmp_path / "e2e.json").read_text())
    assert [r["row"] for r in saved["rows"]] == list(rows)
    assert saved["copy_bandwidth_Bps"] > 0
