"""The vLLM export: a complete transformers checkpoint holding the de-quantised weights the project serves."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from app.engine.loader import local_checkpoint
from loadtest.vllm_peer import export


@pytest.mark.slow
def test_export_is_a_complete_checkpoint_with_the_served_weights(tmp_path):
    out = export(tmp_path / "smollm2", dtype="bfloat16")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    src = local_checkpoint()
    source, exported = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(exported) == set(source) - {"lm_head.weight"}
    for name, tensor in source.items():
        if name in exported:
            assert exported[name].dtype == torch.bfloat16
            assert torch.equal(exported[name], tensor.to(torch.bfloat16)), name
    messages = [{"role": "user", "content": "What is 2+3?"}]
    ours, theirs = (AutoTokenizer.from_pretrained(p, local_files_only=True) for p in (src, out))
    assert theirs.apply_chat_template(messages, add_generation_prompt=True) == \
        ours.apply_chat_template(messages, add_generation_prompt=True)
