"""The `mtpjax` command line: a small generate run, its summary, and a clear error."""

from mtpjax.cli import main


def test_generate_random_model_prints_outputs_and_acceptance(capsys):
    rc = main(["generate", "--random", "-k", "2", "--prompt-ids", "1,2,3", "--prompt-ids", "4,5",
               "--max-tokens", "4", "--num-pages", "32", "--max-num-seqs", "2",
               "--max-num-batched-tokens", "64"])
    out = capsys.readouterr().out
    assert rc in (None, 0)
    assert out.count("(length)") == 2
    assert "2 requests, 8 tokens" in out
    assert "acceptance rate" in out and "mean acceptance length" in out


def test_bad_prompt_is_a_clear_error(capsys):
    rc = main(["generate", "--random", "--prompt-ids", "1,2,5000", "--num-pages", "32"])
    assert rc == 2
    assert "token id 5000 outside the vocabulary [0, 1024)" in capsys.readouterr().err
