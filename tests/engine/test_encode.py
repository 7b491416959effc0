"""Prompt text to token ids (``TargetEngine.encode`` / ``encode_chat``): the tokenizer's own special tokens (a Llama
tokenizer's BOS) where the caller asks for them, as a completion prompt gets them by default (vLLM's and Hugging
Face's rule); a chat template's text as the template writes it unless asked."""

from __future__ import annotations


def test_the_tokenizer_s_special_tokens_are_added_on_request_only(engine, monkeypatch):
    """SmolLM2's tokenizer adds none: given a Llama-style post-processor that prepends a BOS, a text and a chat
    template's text get it with ``add_special_tokens`` only."""
    from tokenizers.processors import TemplateProcessing

    bos = engine.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    llama_style = TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    monkeypatch.setattr(engine.tokenizer.backend_tokenizer, "post_processor", llama_style)
    plain = engine.encode("Hello world")
    assert plain and bos not in plain
    assert engine.encode("Hello world", add_special_tokens=True) == [bos] + plain
    messages = [{"role": "user", "content": "hi"}]
    assert engine.encode_chat(messages, add_special_tokens=True) == [bos] + engine.encode_chat(messages)
