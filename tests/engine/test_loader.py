"""load_format='dummy': random weights on a config.json + tokenizer directory, seeded, shaped as the config says."""

from __future__ import annotations

import math

import pydantic
import pytest
import torch

from app.loop import generate
from app.engine.config import EngineConfig
from app.engine.engine import TargetEngine
from app.engine.greedy_head import SCREEN_MARGIN, SCREEN_TOP
from app.engine.loader import DUMMY_LOGIT_STD, DUMMY_STD, load_target
from app.engine.model import KVCache, StepLayout
from app.engine.types import SamplingParams
from tests.conftest import TINY_LLAMA, write_model_dir


@pytest.mark.parametrize("tied", [False, True])
def test_dummy_weights_follow_the_config(tmp_path, tied):
    src = write_model_dir(tmp_path / "m", {**TINY_LLAMA, "tie_word_embeddings": tied})
    model = load_target(str(src), load_format="dummy", device="cpu", dtype="bfloat16").model
    a = model.args
    assert (a.hidden_size, a.num_layers, a.num_heads, a.num_kv_heads, a.vocab_size) == (64, 2, 4, 2, 49152)
    embed = model.embed_tokens.weight
    assert embed.dtype == torch.bfloat16 and embed.shape == (49152, 64)
    head_std = DUMMY_LOGIT_STD / math.sqrt(64)
    assert embed.float().std().item() == pytest.approx(head_std if tied else DUMMY_STD, rel=0.05)
    assert model.layers[0].qkv.weight.shape == (4 * 16 + 2 * 2 * 16, 64)
    assert torch.equal(model.layers[1].input_norm, torch.ones(64, dtype=torch.bfloat16))
    head = model.lm_head.weight  # the float32 copy of the LM head
    assert head.dtype == torch.float32
    assert torch.equal(head, embed.float()) == tied
    assert head.std().item() == pytest.approx(head_std, rel=0.05)
    again = load_target(str(src), load_format="dummy", device="cpu", dtype="bfloat16").model
    assert torch.equal(again.layers[1].down_proj.weight, model.layers[1].down_proj.weight)  # seeded


@pytest.mark.parametrize("tied", [False, True])
def test_dummy_logits_spread_as_a_trained_models(tmp_path, tied):
    """A dummy model's logits have std DUMMY_LOGIT_STD over the vocabulary and few rows flat for the greedy screen
    (its SCREEN_TOP best within 2 x SCREEN_MARGIN of the best: the float32 fallback), as on real weights; drawn at
    DUMMY_STD, every row would be flat."""
    src = write_model_dir(tmp_path / "m", {**TINY_LLAMA, "tie_word_embeddings": tied})
    model = load_target(str(src), load_format="dummy", device="cpu", dtype="bfloat16").model
    cache = KVCache(model.args, num_slots=1, max_len=128, dtype=torch.bfloat16, device="cpu")
    layout = StepLayout.build(slots=[0], starts=[0], lengths=[100], groups=2, device=torch.device("cpu"),
                              dtype=torch.bfloat16)
    with torch.inference_mode():
        logits, _ = model(torch.arange(100) * 37, cache=cache, layout=layout, logits_index=torch.arange(100))
    assert logits.std(-1).median().item() == pytest.approx(DUMMY_LOGIT_STD, rel=0.1)
    top = logits.topk(SCREEN_TOP, dim=-1).values
    flat = top[:, -1] >= top[:, 0] - 2 * SCREEN_MARGIN
    assert flat.float().mean().item() <= 0.05


def test_dummy_engine_decodes_deterministically(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), load_format="dummy", device="cpu", max_model_len=256,
                          max_num_seqs=4)
    runs = []
    for _ in range(2):
        engine = TargetEngine(config)
        prompts = [engine.encode_chat([{"role": "user", "content": text}]) for text in ("Hi!", "What is 2+3?")]
        results, _ = generate(engine, prompts, SamplingParams(max_tokens=12, ignore_eos=True))
        runs.append([r.token_ids for r in results])
    assert [len(ids) for ids in runs[0]] == [12, 12]
    assert all(0 <= t < 49152 for ids in runs[0] for t in ids)
    assert runs[0] == runs[1]


def test_load_errors_name_the_problem(tmp_path, tiny_llama_dir):
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors"):
        load_target(str(tiny_llama_dir), device="cpu")  # 'auto' still needs the checkpoint's weights
    bare = write_model_dir(tmp_path / "bare", TINY_LLAMA, tokenizer=False)
    with pytest.raises(FileNotFoundError, match="no tokenizer in .*bare"):
        load_target(str(bare), load_format="dummy", device="cpu")
    with pytest.raises(ValueError, match="load_format must be one of"):
        load_target(str(tiny_llama_dir), load_format="random", device="cpu")
    for missing in (str(tmp_path / "no-such-model"), "no-such-org/no-such-model"):  # a path; an id not cached
        with pytest.raises(FileNotFoundError, match=f"model '{missing}' is neither an embedded model"):
            load_target(missing, load_format="dummy", device="cpu")
    with pytest.raises(pydantic.ValidationError, match="load_format"):
        EngineConfig(load_format="random")


@pytest.mark.parametrize("bf16_kernels, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_is_bfloat16_only_where_the_cpu_computes_it_natively(monkeypatch, bf16_kernels, expected):
    from app.engine import loader

    monkeypatch.setattr(loader, "cpu_has_bf16_kernels", lambda: bf16_kernels)
    assert loader.resolve_dtype("auto", torch.device("cpu")) == expected
    assert loader.resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert loader.resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16  # named: as named
    with pytest.raises(ValueError, match="got 'fp8'"):
        loader.resolve_dtype("fp8", torch.device("cpu"))


def test_a_cpu_hardware_name_carries_the_vector_isa():
    from app.engine.hardware import hardware_name

    name = hardware_name(torch.device("cpu"), 3)
    assert name.endswith(f" {torch.backends.cpu.get_cpu_capability()} 3 threads")
