"""``TokenBytes``: each token's own bytes (OpenAI's logprobs ``bytes``), for byte-level BPE, SentencePiece-style and
other tokenizers."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from app.engine.detokenizer import TokenBytes, TokenTexts, byte_level_alphabet
from app.engine.testing import MockTokenizer

TEXT = "Emojis 😀🎉, accents é ñ, CJK 漢字, tab\tand newline\n!"


def test_byte_level_alphabet_spells_every_byte_once():
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert alphabet["Ġ"] == 0x20 and alphabet["Ċ"] == 0x0A and alphabet["a"] == ord("a")


def test_byte_level_tokens_join_to_the_text_where_decoding_each_alone_cannot():
    from app.engine.loader import local_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(local_checkpoint(), local_files_only=True)
    token_bytes = TokenBytes(tokenizer)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert b"".join(token_bytes(i) for i in ids) == TEXT.encode()
    alone = b"".join(tokenizer.decode([i]).encode() for i in ids)
    assert alone != TEXT.encode()  # some token ends inside a character: decoded alone it reads U+FFFD
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert token_bytes(im_end) == b"<|im_end|>"  # an added token is its text


def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """A tiny Llama-2-style tokenizer: ``▁`` for spaces, byte-fallback tokens ``<0xAB>`` for what the vocabulary
    lacks."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}, "▁": 259, "h": 260,
             "i": 261, "▁h": 262, "▁hi": 263, "é": 264}
    tok = Tokenizer(models.BPE(vocab, [("▁", "h"), ("▁h", "i")], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_sentencepiece_pieces_and_byte_fallback_tokens():
    tokenizer = sentencepiece_tokenizer()
    token_bytes = TokenBytes(tokenizer)
    ids = tokenizer.encode("hi é😀", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids)[-4:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert [token_bytes(i) for i in ids] == [b" hi", b" ", "é".encode(), b"\xf0", b"\x9f", b"\x98", b"\x80"]
    assert token_bytes(tokenizer.eos_token_id) == b"</s>"


@pytest.mark.parametrize("token_id", [5, 17, 300])
def test_a_tokenizer_without_a_known_decoder_gives_the_text_of_the_token_alone(token_id):
    tokenizer = MockTokenizer()
    assert TokenBytes(tokenizer)(token_id) == tokenizer.decode([token_id]).encode()


def test_token_texts_decode_each_token_alone_once():
    """``TokenTexts``: a token's text is ``decode([id])``, worked out on its first use only (a scored prompt asks for
    the same alternatives row after row)."""
    tokenizer = MockTokenizer()
    calls = []
    decode = tokenizer.decode
    tokenizer.decode = lambda ids, **kw: calls.append(list(ids)) or decode(ids, **kw)
    texts = TokenTexts(tokenizer)
    assert [texts(t) for t in (5, 17, 5, 5, 17)] == [decode([t]) for t in (5, 17, 5, 5, 17)]
    assert calls == [[5], [17]]
