"""fa4dist.data.tokenizer: the byte tokenizer's round trip and its refusal of what is not text or ids."""

import pytest
import torch

from fa4dist.data.tokenizer import BOS, EOS, ByteTokenizer


def test_special_tokens_and_stray_bytes():
    tok = ByteTokenizer()
    assert tok.encode("") == [BOS, EOS] and tok.encode("", bos=False, eos=False) == []
    assert tok.decode(tok.encode("héllo 😀")) == "héllo 😀"
    assert tok.decode(torch.tensor([97, 300, -1, 98])) == "ab"  # ids outside the bytes dropped, tensor ids taken
    assert tok.decode([0xC3]) == "\ufffd"  # a stray byte: a replacement character


@pytest.mark.parametrize("text", [b"abc", None, 5])
def test_encode_refuses_what_is_not_text(text):
    """bytes or None were an AttributeError ('bytes' object has no attribute 'encode')."""
    with pytest.raises(TypeError, match=f"text must be a str, got {type(text).__name__}"):
        ByteTokenizer().encode(text)


def test_encode_flags_are_bools():
    with pytest.raises(TypeError, match="bos must be a bool, got int"):
        ByteTokenizer().encode("a", bos=0)
    with pytest.raises(TypeError, match="eos must be a bool, got str"):
        ByteTokenizer().encode("a", eos="no")


@pytest.mark.parametrize("ids, shown", [([97, 1.7], "float 1.7"), (["a"], "str 'a'"), ([97, True], "bool True"),
                                       (torch.tensor([True, False]), r"torch.Tensor tensor\(True\)")])
def test_decode_refuses_ids_that_are_not_integers(ids, shown):
    """1.7 was read as byte 1 (int() truncates); a bool, or a bool tensor's element (a mask given for the ids), as
    byte 1 or 0."""
    with pytest.raises(TypeError, match=f"ids must be integer token ids, got {shown}"):
        ByteTokenizer().decode(ids)


@pytest.mark.parametrize("ids", [None, 5, torch.tensor(97)])
def test_decode_refuses_what_is_not_a_sequence_of_ids_by_name(ids):
    """None, an int or a 0-d tensor was torch's or Python's own TypeError ("'int' object is not iterable",
    "iteration over a 0-d tensor"), naming nothing of decode's."""
    with pytest.raises(TypeError, match="ids must be a sequence of integer token ids, got "):
        ByteTokenizer().decode(ids)


def test_a_pretrained_tokenizer_frames_documents_like_the_byte_tokenizer(tmp_path):
    pytest.importorskip("transformers")
    from fa4dist.data import PackedTokenStream, PretrainedTokenizer
    from tiny_tokenizer import make_hf_tokenizer

    texts = ["the quick brown fox jumps over the lazy dog " * 20, "packed documents for context parallelism " * 20]
    tok = PretrainedTokenizer(make_hf_tokenizer(tmp_path / "tok", texts))
    ids = tok.encode(texts[0])
    assert ids[-1] == tok.eos_id and tok.tokenizer.decode(ids[:-1]) == texts[0]
    assert len(ids) < len(texts[0]) // 2  # merges: fewer ids than bytes
    stream = PackedTokenStream(texts, 64, tokenizer=tok)
    assert int(stream.tokens.max()) < tok.vocab_size
    with pytest.raises(ValueError, match="is not a local transformers tokenizer directory"):
        PretrainedTokenizer(tmp_path / "missing")
    with pytest.raises(TypeError, match="text must be a str"):
        tok.encode(b"bytes")
    # a special token's text inside a document is text: transformers' default made "</s>" (HTML's strike-through)
    # the EOS token, an end of document inside one, with no boundary there
    special = tok.tokenizer.eos_token
    for text in (f"fox{special}", f"{special} fox"):
        ids = tok.encode(text)
        assert ids.count(tok.eos_id) == 1 and ids[-1] == tok.eos_id, (text, ids)


def test_a_pretrained_tokenizers_vocab_size_is_above_every_id_it_produces(tmp_path):
    """len(tokenizer) counts the tokens, not the ids: a vocabulary whose ids have a gap (here 0..3 and 500) had
    vocab_size 5, so the model was built with 5 embeddings (the recipe's vocabulary check passed it) and id 500
    indexed past them. vocab_size is now the largest id + 1 (or len, when larger)."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from fa4dist.data import PackedTokenStream, PretrainedTokenizer

    words = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "<s>": 1, "</s>": 2, "the": 3, "fox": 500},
                                       unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(tmp_path / "tok")
    tok = PretrainedTokenizer(tmp_path / "tok")
    assert tok.encode("the fox") == [3, 500, 2]
    assert tok.vocab_size == 501
    assert int(PackedTokenStream(["the fox the"], 4, tokenizer=tok).tokens.max()) < tok.vocab_size
