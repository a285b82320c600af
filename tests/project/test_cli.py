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


def test_generate_fused_projections_gives_the_same_tokens(capsys):
    args = ["generate", "--random", "--prompt-ids", "1,2,3", "--prompt-ids", "4,5",
            "--max-tokens", "6", "--num-pages", "32", "--max-num-seqs", "2"]
    main(args)
    plain = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[")]
    main(args + ["--fuse-projections"])
    fused = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[")]
    assert len(plain) == 2 and fused == plain


def test_bad_prompt_is_a_clear_error(capsys):
    rc = main(["generate", "--random", "--prompt-ids", "1,2,5000", "--num-pages", "32"])
    assert rc == 2
    assert "token id 5000 outside the vocabulary [0, 1024)" in capsys.readouterr().err


def test_convert_both_ways_with_summary(tmp_path, capsys):
    import jax.numpy as jnp
    import numpy as np

    from mtpjax.checkpoint import export_hf, load_hf
    from tests.conftest import random_params, tiny_config
    cfg = tiny_config(model_type="mimo", qkv_bias=True, num_mtp_layers=1,
                      mtp_concat_order="hidden_embed", mtp_normed_hidden_to_next=True)
    params = random_params(cfg)
    export_hf(str(tmp_path / "hf"), params, cfg)
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "orbax")]) in (None, 0)
    out = capsys.readouterr().out
    assert "(HF -> Orbax): mimo, 43 tensors, 0.15 MB, 2 target layers, 1 MTP layers (mimo layout)" \
        in out
    assert main(["convert", str(tmp_path / "orbax"), str(tmp_path / "back"), "--to", "hf",
                 "--dtype", "bfloat16", "--max-shard-size", "20KB", "--no-progress"]) in (None, 0)
    assert "(Orbax -> HF): mimo, 43 tensors, 0.07 MB" in capsys.readouterr().out
    assert (tmp_path / "back" / "model.safetensors.index.json").exists()
    back = load_hf(str(tmp_path / "back"))
    for got, want in zip(back.params["mtp"], params["mtp"], strict=True):
        np.testing.assert_array_equal(np.asarray(got["eh_proj"]),
                                      np.asarray(want["eh_proj"].astype(jnp.bfloat16)))
    # the wrong direction for the folder is a clear error, and writes nothing
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "x"), "--to", "hf"]) == 2
    assert "is a Hugging Face folder; converting to hf needs an Orbax folder" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_generate_from_an_orbax_folder_with_its_tokenizer(tmp_path, capsys):
    from mtpjax.checkpoint import Assets, save
    from tests.conftest import random_params, tiny_config, write_tokenizer
    cfg = tiny_config(vocab_size=128, num_mtp_layers=1)
    params = random_params(cfg)
    write_tokenizer(tmp_path, 128)
    save(str(tmp_path / "ck"), params, cfg,
         assets=Assets(None, {"tokenizer.json": (tmp_path / "tokenizer.json").read_bytes()}))
    rc = main(["generate", "--model", str(tmp_path / "ck"), "-k", "2", "--prompt", "t1 t2 t3",
               "--max-tokens", "4", "--num-pages", "32", "--max-num-seqs", "2",
               "--max-num-batched-tokens", "64"])
    out = capsys.readouterr().out
    assert rc in (None, 0)
    line = next(ln for ln in out.splitlines() if ln.startswith("[0] (length) "))
    words = line[len("[0] (length) "):].split()
    assert len(words) == 4 and all(w.startswith("t") for w in words)
    assert "acceptance rate" in out
