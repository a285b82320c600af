"""Checkpoint conversion: Hugging Face safetensors <-> mtpjax params <-> Orbax.

    load_hf(path, dtype)            HF folder (any family of mtpjax/models/) -> Checkpoint, streamed
    save(path, params, cfg)         Orbax folder with config and tokenizer beside the arrays
    restore(path, sharding)         Orbax folder -> Checkpoint, straight into a sharding
                                    (mesh=: the sharding table's, docs/parallel.md; load_hf too)
    export_hf(path, params, cfg)    params -> HF folder (same names, config, tokenizer)
    load_pretrained(path)           either kind of folder -> Checkpoint
    convert(src, dst, to=...)       folder -> folder, what `mtpjax convert` runs
    from_hf_state_dict(cfg, tensors)  in-memory HF tensors -> params (same key table)

See docs/checkpoints.md for the tensor tables and folder layouts.
"""

from mtpjax.checkpoint.bundle import Assets, Checkpoint, Tokenizer
from mtpjax.checkpoint.errors import CheckpointError
from mtpjax.checkpoint.hf_export import export_hf
from mtpjax.checkpoint.hf_keys import from_hf_state_dict, key_table
from mtpjax.checkpoint.hf_load import load_hf
from mtpjax.checkpoint.orbax_io import restore, save
from mtpjax.checkpoint.pretrained import ConversionSummary, convert, load_pretrained

__all__ = ["Assets", "Checkpoint", "CheckpointError", "ConversionSummary", "Tokenizer", "convert",
           "export_hf", "from_hf_state_dict", "key_table", "load_hf", "load_pretrained", "restore",
           "save"]
