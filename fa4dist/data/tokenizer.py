"""Tokenizers for packed training data.

:class:`ByteTokenizer`: every UTF-8 byte is a token, plus BOS, EOS and PAD.  No vocabulary file, nothing to
download or train: the same text gives the same ids on every machine.  The vocabulary is rounded up to a multiple
of 64 (``VOCAB_SIZE``) so embedding and LM-head matmuls stay aligned; the ids above ``PAD`` are never produced.

:class:`PretrainedTokenizer`: a Hugging Face tokenizer from a local directory (a checkpoint's own), each document
framed as ByteTokenizer frames it (the tokenizer's BOS where it adds one, its EOS at the end).
"""

from __future__ import annotations

import operator
from typing import Iterable

import torch

from ..kernels.problem import check_bool, type_name

BOS = 256
EOS = 257
PAD = 258
VOCAB_SIZE = 320  # 259 used ids, rounded up to a multiple of 64


class ByteTokenizer:
    bos_id = BOS
    eos_id = EOS
    pad_id = PAD
    vocab_size = VOCAB_SIZE

    def encode(self, text: str, *, bos: bool = True, eos: bool = True) -> list[int]:
        if not isinstance(text, str):  # bytes or None were an AttributeError ('bytes' object has no 'encode')
            raise TypeError(f"text must be a str, got {type_name(text)}")
        check_bool("bos", bos)
        check_bool("eos", eos)
        ids = list(text.encode("utf-8"))
        if bos:
            ids.insert(0, BOS)
        if eos:
            ids.append(EOS)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes back to text; special tokens are dropped, stray bytes decode with replacement characters."""
        try:
            ids = iter(ids)
        except TypeError:  # (None, 5 or a 0-d tensor: "'int' object is not iterable", not naming ids)
            raise TypeError(f"ids must be a sequence of integer token ids, got {type_name(ids)}") from None
        values = []
        for i in ids:
            try:
                # an int, a numpy or 0-d integer tensor id; 1.7 was read as byte 1, True (a mask's element) as byte 1
                if isinstance(i, bool) or getattr(i, "dtype", None) == torch.bool:
                    raise TypeError
                values.append(operator.index(i))
            except TypeError:
                raise TypeError(f"ids must be integer token ids, got {type_name(i)} {i!r}") from None
        return bytes(i for i in values if 0 <= i < 256).decode("utf-8", errors="replace")


class PretrainedTokenizer:
    """``transformers.AutoTokenizer`` from the local directory ``path`` (nothing is downloaded) with
    :class:`ByteTokenizer`'s ``encode(text)``: the text's ids with the tokenizer's special tokens, then its EOS
    (when it has one and did not add it), so that a packed stream's documents end as the byte tokenizer's do.  A
    special token's text inside a document (``</s>``: HTML's strike-through tag) is encoded as text, not as the
    token (transformers' default), which put an EOS inside a document with no boundary there.
    ``vocab_size``: every id it can produce is below it (its largest id + 1, added tokens included; at least
    ``len(tokenizer)``)."""

    def __init__(self, path):
        from transformers import AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError, TypeError) as err:
            raise ValueError(f"{str(path)!r} is not a local transformers tokenizer directory ({err})") from None
        # len() counts the tokens, not the ids: a vocabulary with a gap in its ids has ids at or past it
        self.vocab_size = max(len(self.tokenizer), max(self.tokenizer.get_vocab().values(), default=-1) + 1)
        self.eos_id = self.tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type_name(text)}")
        # (verbose=False: a document longer than the model's context is expected here, the stream cuts windows)
        ids = list(self.tokenizer(text, add_special_tokens=True, verbose=False, split_special_tokens=True)["input_ids"])
        if self.eos_id is not None and (not ids or ids[-1] != self.eos_id):
            ids.append(self.eos_id)
        return ids
