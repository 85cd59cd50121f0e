"""The tokenizer a store holds (``tokenizer.json`` among the import's tokenizer files), and
prompts through it. A trainer run has none: its vocabulary is the 256 byte values, which
:func:`byte_tokenizer_files` writes as a tokenizer for an export."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import tierstore

from .layout import TOKENIZER_KIND, TOKENIZER_PREFIX, StoredModel

if TYPE_CHECKING:
    import tokenizers


def parse_tokenizer(raw: bytes, where: str, fix: str) -> tokenizers.Tokenizer:
    """``tokenizer.json``'s bytes as a ``tokenizers.Tokenizer`` that has encoded and decoded
    a line of text; anything else is a :class:`tierstore.StoreError` naming ``where`` and
    saying what to do (``fix``)."""
    import tokenizers

    try:
        tok = tokenizers.Tokenizer.from_str(raw.decode("utf-8"))
        tok.decode(tok.encode("The quick brown fox, 0123456789.").ids)
    except Exception as e:  # noqa: BLE001  (tokenizers raises plain Exceptions)
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise tierstore.StoreError(f"{where} does not load as a tokenizer ({why}); "
                                   f"{fix}") from e
    return tok


def load_tokenizer(store: tierstore.Store) -> tokenizers.Tokenizer | None:
    """The store's ``tokenizer.json`` as a ``tokenizers.Tokenizer``; ``None`` when the model
    has none. A damaged one is a one-line :class:`tierstore.StoreError`."""
    name = TOKENIZER_PREFIX + "tokenizer.json"
    if (name, TOKENIZER_KIND) not in store:
        return None
    return parse_tokenizer(store.get(name, TOKENIZER_KIND).numpy().tobytes(),
                           f"store {store.path}: its tokenizer.json",
                           "import the model again from a directory whose tokenizer loads, "
                           "or pass --prompt-ids")


def tokenizer_files(store: tierstore.Store) -> dict[str, bytes]:
    """Every stored tokenizer file, by its original file name."""
    names = store.names(TOKENIZER_PREFIX, kind=TOKENIZER_KIND)
    return {n[len(TOKENIZER_PREFIX):]: store.get(n, TOKENIZER_KIND).numpy().tobytes()
            for n in names}


def encode_prompts(store: tierstore.Store, stored: StoredModel, texts: Sequence[str]
                   ) -> tuple[list[list[int]], Any]:
    """Token ids of text prompts through the store's tokenizer (a trainer run, which has
    none, reads UTF-8 bytes), and the tokenizer (None for bytes)."""
    tok = load_tokenizer(store)
    if tok is not None:
        return [tok.encode(t).ids for t in texts], tok
    if stored.step is not None:
        return [list(t.encode("utf-8")) for t in texts], None
    raise tierstore.StoreError(f"store {store.path} holds no tokenizer: pass token ids with "
                               "--prompt-ids")


def byte_tokenizer_files(max_length: int) -> dict[str, bytes]:
    """``tokenizer.json`` and ``tokenizer_config.json`` of a trainer run's byte-level
    vocabulary: token id = byte value of the UTF-8 text, no special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # GPT-2's printable stand-ins for the 256 byte values, which the ByteLevel steps use.
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
              "clean_up_tokenization_spaces": False}
    return {"tokenizer.json": tok.to_str().encode(),
            "tokenizer_config.json": json.dumps(config, indent=2).encode()}
