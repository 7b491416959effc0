"""Weightless model directories of published architectures (app/engine/shapes.py): the engine reads each as that
model's shapes, and one loads with dummy weights and decodes."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from app.engine.config import EngineConfig
from app.engine.engine import TargetEngine
from app.engine.model import ModelArgs
from app.engine.shapes import SHAPES, main, write_shape_dir
from app.engine.types import SamplingParams
from app.loop import generate

# (layers, hidden, heads, kv heads, head dim, MLP, vocabulary, tied head, rotary type)
PUBLISHED = {
    "smollm2-135m": (30, 576, 9, 3, 64, 1536, 49152, True, "default"),
    "llama-3.1-8b": (32, 4096, 32, 8, 128, 14336, 128256, False, "llama3"),
    "qwen3-8b": (36, 4096, 32, 8, 128, 12288, 151936, False, "default"),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_each_shape_reads_as_its_published_architecture(tmp_path, name):
    directory = write_shape_dir(name, tmp_path / name)
    a = ModelArgs.from_hf_config(AutoConfig.from_pretrained(directory, local_files_only=True))
    assert (a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, a.intermediate_size, a.vocab_size,
            a.tie_word_embeddings, a.rope_scaling.rope_type) == PUBLISHED[name]
    assert a.qk_norm == (name == "qwen3-8b")


def test_a_shape_directory_loads_with_dummy_weights_and_decodes(tmp_path):
    directory = write_shape_dir("smollm2-135m", tmp_path / "small", overrides={"num_hidden_layers": 2})
    engine = TargetEngine(EngineConfig(model=str(directory), load_format="dummy", device="cpu", dtype="float32",
                                       max_num_seqs=2, max_model_len=64))
    (result,), _ = generate(engine, [[1, 7, 300, 4000]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(result.token_ids) == 4 and result.text.split() == [f"t{t}" for t in result.token_ids]


def test_an_unknown_shape_names_the_known_ones(tmp_path, capsys):
    with pytest.raises(KeyError, match="llama-3.1-8b"):
        write_shape_dir("llama-9", tmp_path)
    assert main(["--list"]) == 0 and "qwen3-8b: 36 layers" in capsys.readouterr().out
