"""Building an engine's inputs: a checkpoint folder loaded for `LLM` (`load_for_engine`, which
`LLM.from_pretrained` and `DataParallelLLM.from_pretrained` share), the check that a params tree
fits its config, and the once-per-process start-up that keeps the garbage collector off the
serving path.
"""

from __future__ import annotations

import gc
import warnings

import jax

from mtpjax.config import ModelConfig


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def check_params(params, cfg: ModelConfig) -> None:
    """ValueError naming the first leaf whose path or shape differs from the config's parameter
    tree (`mtpjax.model.params.abstract_params(cfg)`); dtypes are not compared."""
    from mtpjax.model.fp8_weight import is_fp8
    from mtpjax.model.params import abstract_params
    want = {_path_str(p): tuple(x.shape) for p, x in
            jax.tree_util.tree_flatten_with_path(abstract_params(cfg))[0]}
    try:
        leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_fp8)[0]   # FP8: one leaf
    except Exception as e:          # noqa: BLE001 -- anything that is not a tree of arrays
        raise ValueError(f"params must be a nested dict of arrays, got {type(params).__name__}") \
            from e
    have = {_path_str(p): x for p, x in leaves}
    for path, shape in want.items():
        if path not in have:
            raise ValueError(f"params do not match the config: missing leaf {path!r} (expected "
                             f"shape {shape})")
        got = getattr(have[path], "shape", None)
        if got is None or tuple(got) != shape:
            raise ValueError(f"params do not match the config: leaf {path!r} has shape "
                             f"{None if got is None else tuple(got)}, expected {shape}")
    extra = [p for p in have if p not in want]
    if extra:
        raise ValueError(f"params do not match the config: unexpected leaf {extra[0]!r} (shape "
                         f"{tuple(getattr(have[extra[0]], 'shape', ()))}) is not in the config's "
                         "parameter tree")


def load_for_engine(path: str, spec, dtype, mesh, llm_kwargs: dict, fp8: str | None = None):
    """(params, cfg, llm_kwargs with the folder's tokenizer, eos id and — for
    `SpecConfig(draft_vocab_size=N)` — draft_vocab.json unless given): `from_pretrained`'s load."""
    from mtpjax.checkpoint import load_pretrained
    from mtpjax.speculative.draft_vocab import load_ranked_ids
    ckpt = load_pretrained(path, dtype, spec=spec, mesh=mesh, fp8=fp8)
    llm_kwargs = dict(llm_kwargs)
    llm_kwargs.setdefault("tokenizer", ckpt.tokenizer)
    if "chat_template" not in llm_kwargs and llm_kwargs["tokenizer"] is ckpt.tokenizer \
            and ckpt.tokenizer is not None:
        from mtpjax.serve.chat_template import ChatTemplate, ChatTemplateError, chat_encoder
        try:
            llm_kwargs["chat_template"] = ChatTemplate.from_folder(path)
        except ChatTemplateError as e:
            # token-id and text prompts still work; chat prompts then say there is no template
            warnings.warn(f"{e}; chat prompts are refused (pass LLM(..., chat_template=))",
                          stacklevel=3)
        else:
            llm_kwargs["tokenizer"] = _ChatTokenizer(ckpt.tokenizer, chat_encoder(
                path, ckpt.tokenizer.encode))
    llm_kwargs.setdefault("eos_token_id", ckpt.eos_token_id)
    if spec is not None and spec.draft_vocab_size is not None \
            and llm_kwargs.get("draft_vocab") is None:
        llm_kwargs["draft_vocab"] = load_ranked_ids(path)
    return ckpt.params, ckpt.cfg, llm_kwargs


class _ChatTokenizer:
    """A checkpoint's tokenizer plus `encode_chat`: rendered chats are encoded without the
    tokenizer's own special tokens, since the template writes them (as transformers does)."""

    def __init__(self, tokenizer, encode_chat):
        self._tokenizer, self.encode_chat = tokenizer, encode_chat

    def encode(self, text):
        return self._tokenizer.encode(text)

    def decode(self, ids):
        return self._tokenizer.decode(ids)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


_FROZEN = False


def freeze_startup_objects() -> None:
    """Once per process, at the first engine: move everything alive then (params, modules,
    compiled-code caches) out of the collector's reach, so a full collection between steps stays
    short (with async scheduling a host pause longer than a step stalls the device). Once only:
    a frozen object that later becomes cyclic garbage is never collected."""
    global _FROZEN
    if not _FROZEN:
        gc.collect()
        gc.freeze()
        _FROZEN = True
