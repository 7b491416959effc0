"""Export the default target as a plain transformers checkpoint for vLLM's CPU build (the comparison peer).

vLLM needs safetensors with a complete ``config.json`` (``architectures`` included), not the GGUF the
project ships. The de-quantised weights already cached by ``app/engine/loader.py`` are reused: a fresh
model is built from their config, loads them (the tied ``lm_head`` is re-tied), and is saved with
``save_pretrained`` (transformers refuses that on a GGUF-loaded model) beside the tokenizer and chat template.

    python -m loadtest.vllm_peer export --out ~/.cache/dspark-serve/vllm-export/smollm2-135m

Runs in the project's virtualenv (torch + transformers). Starting vLLM itself, in its own virtualenv, is
``scripts/vllm_cpu_peer.sh`` (see ``docs/loadtest.md``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DTYPES = ("bfloat16", "float32")


def export(out: Path, *, model: str = "smollm2-135m", dtype: str = "bfloat16") -> Path:
    """Write ``model`` as a transformers checkpoint (config, safetensors, tokenizer) into ``out``.

    Raises:
        ValueError: an unsupported dtype, or weights that do not fit the model built from the config.
        FileNotFoundError: the model reference names no local checkpoint.
    """
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from app.engine.loader import local_checkpoint

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    src = local_checkpoint(model)
    config = AutoConfig.from_pretrained(src, local_files_only=True)
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(f))
    missing, unexpected = hf_model.load_state_dict(state, strict=False)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise ValueError(f"weights do not fit {type(hf_model).__name__}: missing {missing}, unexpected {unexpected}")
    hf_model.tie_weights()
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    hf_model.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(src, local_files_only=True).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    exp = sub.add_parser("export", help="write the model as safetensors for vLLM")
    exp.add_argument("--out", type=Path, required=True)
    exp.add_argument("--model", default="smollm2-135m", help="model reference (see app/engine/loader.py)")
    exp.add_argument("--dtype", default="bfloat16", choices=DTYPES,
                     help="stored dtype (bfloat16: what both servers run; float32: the exact de-quantised values)")
    args = ap.parse_args(argv)
    out = export(args.out, model=args.model, dtype=args.dtype)
    print(json.dumps({"exported": str(out), "model": args.model, "dtype": args.dtype}))


if __name__ == "__main__":
    main()
