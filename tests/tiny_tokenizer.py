"""A small transformers tokenizer the data and recipe tests train on the spot (nothing downloaded)."""

from __future__ import annotations


def make_hf_tokenizer(directory, texts, vocab_size: int = 300) -> str:
    """A small byte-level BPE tokenizer trained on ``texts``, saved as a transformers tokenizer directory (with
    BOS and EOS, no post-processor: it adds no special token itself)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size,
                                                       special_tokens=["<unk>", "<s>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(directory)
    return str(directory)
