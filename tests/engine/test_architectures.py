"""Each supported architecture, built tiny and random with transformers from a config, saved, then loaded through
``model: <dir>``: the engine's logits match transformers' and 32 greedy tokens are the same."""

from __future__ import annotations

import pytest
import torch

from app.loop import generate
from app.engine.config import EngineConfig
from app.engine.engine import TargetEngine
from app.engine.loader import check_target
from app.engine.model import ModelArgs
from app.engine.near_tie import teacher_forced_logits
from app.engine.types import SamplingParams
from tests.conftest import save_tiny_model

SMALL = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
# original_max_position_embeddings 32 < the 72 positions decoded, so every scaling changes the frequencies used
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
CASES = {
    "llama2": ("LlamaConfig", {"tie_word_embeddings": False}),
    "llama3.2-tied": ("LlamaConfig", {"tie_word_embeddings": True, "rope_parameters": LLAMA3_ROPE}),
    "llama3.1-untied": ("LlamaConfig", {"tie_word_embeddings": False, "rope_parameters": LLAMA3_ROPE}),
    "llama-linear": ("LlamaConfig", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0,
                                                          "factor": 2.0}}),
    "llama-dynamic": ("LlamaConfig", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0,
                                                           "factor": 2.0}}),
    "llama-yarn": ("LlamaConfig", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                        "original_max_position_embeddings": 32}}),
    "llama-swish": ("LlamaConfig", {"hidden_act": "swish"}),  # transformers' other name for SiLU
    "mistral": ("MistralConfig", {"tie_word_embeddings": False, "sliding_window": 4096}),
    "qwen2-tied": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": False, "head_dim": 32}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_architecture_matches_transformers(tmp_path, case):
    config_class, overrides = CASES[case]
    hf = save_tiny_model(tmp_path / case, config_class, {**SMALL, **overrides})
    engine = TargetEngine(EngineConfig(model=str(tmp_path / case), dtype="float32", device="cpu", max_model_len=128,
                                       max_num_seqs=2))
    prompt = torch.randint(3, 49152, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
        greedy = list(prompt)
        for _ in range(32):
            greedy.append(int(hf(torch.tensor([greedy])).logits[0, -1].argmax()))
    got = teacher_forced_logits(engine, prompt)
    assert want.std() > 0.5  # logits far from flat, so greedy ties cannot hide a mismatch
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    results, _ = generate(engine, [prompt], SamplingParams(max_tokens=32, ignore_eos=True))
    assert results[0].token_ids == greedy[40:]


def test_sliding_window_caps_the_context():
    from transformers import MistralConfig, Qwen2Config

    assert ModelArgs.from_hf_config(MistralConfig(**SMALL, sliding_window=64)).max_position_embeddings == 64
    assert ModelArgs.from_hf_config(Qwen2Config(**SMALL, sliding_window=64)).max_position_embeddings == 256
    with_window = Qwen2Config(**SMALL, sliding_window=64, use_sliding_window=True)
    assert ModelArgs.from_hf_config(with_window).max_position_embeddings == 64


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "longrope", "rope_theta": 1e4, "factor": 2.0}, "unsupported rope_type 'longrope'"),
    ({"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}, "needs original_max_position_embeddings"),
    ({"rope_type": "linear", "rope_theta": 1e4}, "needs a factor"),
])
def test_unsupported_rope_names_the_problem(rope, message):
    from transformers import LlamaConfig

    config = LlamaConfig(**SMALL)
    config.rope_parameters = rope
    with pytest.raises(ValueError, match=message):
        ModelArgs.from_hf_config(config)


@pytest.mark.parametrize("config_class, field, value", [
    ("LlamaConfig", "attention_bias", True), ("Qwen3Config", "attention_bias", True), ("LlamaConfig", "mlp_bias", True),
    ("LlamaConfig", "hidden_act", "gelu"),
])
def test_config_variants_the_engine_does_not_implement_are_refused(tmp_path, config_class, field, value):
    """A variant the engine would load without its extra weights (the outputs then silently wrong) is refused, from
    the config and, as a second line, from weights nothing would read."""
    import transformers

    config = getattr(transformers, config_class)(**SMALL, **{field: value})
    with pytest.raises(ValueError, match=f"unsupported target config {{'{field}': '?{value}'?}}"):
        ModelArgs.from_hf_config(config)
    save_tiny_model(tmp_path, config_class, {**SMALL, field: value})
    with pytest.raises(ValueError, match=f"unsupported target config {{'{field}'"):
        TargetEngine(EngineConfig(model=str(tmp_path), dtype="float32", device="cpu", max_model_len=256))


def test_flags_transformers_ignores_for_an_architecture_are_ignored_here_too():
    from transformers import MistralConfig, Qwen2Config

    for config_class in (Qwen2Config, MistralConfig):  # their modules never read attention_bias / mlp_bias
        config = config_class(**SMALL)
        config.attention_bias, config.mlp_bias = True, True
        assert ModelArgs.from_hf_config(config).qkv_bias == (config_class is Qwen2Config)


def test_weights_the_engine_has_no_place_for_are_refused(tmp_path):
    import json

    save_tiny_model(tmp_path, "LlamaConfig", {**SMALL, "mlp_bias": True})
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "mlp_bias": False}))  # config and weights disagree
    with pytest.raises(ValueError, match=r"checkpoint tensors this engine does not use, e.g. \['model.layers.0.mlp"):
        TargetEngine(EngineConfig(model=str(tmp_path), dtype="float32", device="cpu", max_model_len=256))


@pytest.mark.parametrize("field, value, message", [
    ("intermediate_size", 96, r"do not have the shapes its config.json implies .*model.layers.0.mlp.gate_proj.weight "
                              r"is \[128, 64\], the config implies \[96, 64\]"),
    ("num_hidden_layers", 3, r"tensors the config.json in .* implies are not in its safetensors, e.g. "
                             r"\['model.layers.2."),
    ("num_key_value_heads", 4, r"model.layers.0.self_attn.k_proj.weight is \[32, 64\], the config implies \[64, 64\]"),
])
def test_a_config_that_disagrees_with_its_weights_is_refused_from_the_headers(tmp_path, field, value, message):
    """Before any weight is read (``check_target``, which the server runs before Ray starts): without the check the
    mismatch surfaced as a tensor-shape or key error inside the Target replica."""
    import json

    save_tiny_model(tmp_path, "LlamaConfig", SMALL)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ValueError, match=message):
        check_target(str(tmp_path))
