"""The demo's GPU figures are the ones docs/benchmarks.md reports (no test runs the whole demo:
its lossless check and statistics are tests/model/test_tiny_model.py's)."""

import os

from mtpjax.demo import GPU_8B_BATCH1, GPU_8B_SEEDS, acceptance_stats

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs",
                    "benchmarks.md")


def _e2e_rows(commit):
    text = open(DOCS).read()
    lines = text[text.index(f"**Plain and MTP, batch 1 and 32** (commit {commit}"):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        c = [x.strip() for x in line.strip("|").split("|")]
        rows[c[0], int(c[1])] = c
    return rows


def test_demo_gpu_numbers_match_docs():
    g = GPU_8B_BATCH1
    rows = _e2e_rows(g["commit"])
    plain, mtp = rows["engine plain", 1], rows["engine MTP K=3", 1]
    assert float(plain[2]) == g["plain_ms"] and float(plain[6]) == g["plain_tok_s"]
    assert float(mtp[2]) == g["mtp_ms"] and float(mtp[6]) == g["mtp_tok_s"]
    assert float(mtp[5]) == g["mtp_tokens_per_step"]


def test_demo_seed_mean_numbers_match_docs():
    g = GPU_8B_SEEDS
    text = open(DOCS).read()
    section = text[text.index(f"**Batch 1 over four seeds** (commit {g['commit']}"):]
    mean = next(line for line in section.splitlines() if line.startswith("| mean |"))
    c = [x.strip().split()[0].strip("*") for x in mean.strip("|").split("|")]
    assert (int(c[2]), int(c[5]), int(c[8])) == (g["plain_tok_s"], g["mtp_tok_s"],
                                                 g["draft_vocab_tok_s"])


class _Out:
    def __init__(self, steps, drafts, accepted):
        self.num_verify_steps, self.num_draft_tokens = steps, drafts
        self.num_accepted_draft_tokens = accepted


def test_acceptance_stats_counts():
    # two requests, K=2: per-step committed tokens (bonus included); last steps left out of the
    # per-position rates and the histogram
    steps = [[3, 1, 2], [2, 3]]
    outs = [_Out(3, 6, 3), _Out(2, 4, 3)]
    s = acceptance_stats(outs, steps, 2)
    assert s["verify_steps"] == 5 and s["acceptance_rate"] == 6 / 10
    assert s["mean_acceptance_length"] == (6 + 5) / 5
    assert s["num_accepted_histogram"] == [0, 1, 1, 1]
    assert s["per_position_acceptance"] == [2 / 3, 1 / 3]
