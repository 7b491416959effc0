"""Published model architectures as weightless model directories, for timing and device checks on dummy weights.

A step's cost does not depend on weight values, so the engine can be timed or checked for exactness on an
architecture from its ``config.json`` alone (``load_target(..., load_format="dummy")``). ``write_shape_dir`` writes
such a directory: the architecture's published configuration and a generated word-level tokenizer with its vocabulary
size (token ``i`` is the word ``t<i>``; the engine detokenizes, so it needs one). Nothing is downloaded: a machine
with no hub access (a lent GPU) gets a Llama-3.1-8B-shaped target from this module.

CLI::

    python -m app.engine.shapes llama-3.1-8b models/llama-3.1-8b    # then --model models/llama-3.1-8b
    python -m app.engine.shapes --list

The shapes are the models' published ``config.json`` values (hidden size, layers, heads, KV heads, head dim, MLP
width, vocabulary, rotary settings, tied head); fields that do not change a step's cost (special-token ids beyond
BOS/EOS, chat templates) are left out. A profile timed on such a directory names its model
``<directory name>-dummy`` (``app/scheduling/profiler.py``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SHAPES: dict[str, dict] = {
    # HuggingFaceTB/SmolLM2-135M-Instruct, the embedded default target
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}, "bos_token_id": 1, "eos_token_id": 2,
    },
    # meta-llama/Llama-3.1-8B-Instruct
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    },
    # Qwen/Qwen3-8B
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "attention_bias": False,
        "bos_token_id": 151643, "eos_token_id": [151645, 151643],
    },
}


def write_shape_dir(name: str, directory: str | Path, *, overrides: dict | None = None) -> Path:
    """Write ``SHAPES[name]`` (updated by ``overrides``, e.g. fewer layers) as ``config.json`` and a word-level
    tokenizer of its vocabulary size into ``directory`` (created); returns the directory.

    Raises:
        KeyError: ``name`` is not in ``SHAPES`` (the message lists them).
    """
    if name not in SHAPES:
        raise KeyError(f"no shape {name!r}; known: {sorted(SHAPES)}")
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = {**SHAPES[name], **(overrides or {})}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    eos = config["eos_token_id"]
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0",
        "bos_token": f"t{config['bos_token_id']}", "eos_token": f"t{eos[0] if isinstance(eos, list) else eos}",
    }))
    return directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", nargs="?", choices=sorted(SHAPES))
    parser.add_argument("directory", nargs="?")
    parser.add_argument("--list", action="store_true", help="print the known shapes and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, config in SHAPES.items():
            print(f"{name}: {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
                  f"vocabulary {config['vocab_size']}")
        return 0
    if not (args.name and args.directory):
        parser.error("name and directory are required (or --list)")
    print(write_shape_dir(args.name, args.directory))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
