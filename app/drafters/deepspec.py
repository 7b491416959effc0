"""DeepSpec's drafter checkpoint format (DeepSeek's DSpark reference code; vLLM, SGLang and TensorRT-LLM load it):
reading it into this project's drafter modules, and writing a drafter trained here to it.

Owns the translation only: the folder's Hugging Face style ``config.json`` (identified by ``architectures``) to and
from ``DrafterConfig``, and the tensor names and layouts of ``model.safetensors`` to and from ``DSparkDrafter``'s
state dict. The math is ``dspark.py``'s (its DeepSpec options: ``qk_norm``, ``feature_norm=False``,
``mask_token_id``, heads "markov" / "gated" / "joint_rnn" / "none", ``confidence``); ``checkpoint.py`` dispatches
a folder here when its ``config.json`` names an architecture.

Supported architectures: ``Qwen3DSparkModel`` (DSpark with a Markov head of ``markov_rank > 0``, or DFlash with
``markov_rank = 0`` and no confidence head) -> ``DSparkDrafter``; ``Qwen3Eagle3Model`` (one draft layer,
``ttt_length`` drafts per round) -> ``EagleDrafter`` with ``fusion="concat"``. Draft layers are Qwen3's (per-head
q/k RMSNorm, no attention bias, SwiGLU); ``fc`` maps the concatenated target features of ``target_layer_ids``
(decoder layers, 0-based; DeepSpec's -1, the embedding output, is not a feature layer of this engine) to the hidden
size (DSpark: then ``hidden_norm``).

Tensor layout (reference name -> this project's):
    ``layers.{i}.self_attn.{q,k,v}_proj.weight`` -> ``layers.{i}.qkv.weight`` (rows concatenated in that order);
    ``layers.{i}.mlp.{gate,up}_proj.weight`` -> ``layers.{i}.gate_up.weight``; ``self_attn.{q,k}_norm.weight``
    -> ``{q,k}_norm``; ``input_layernorm`` / ``post_attention_layernorm`` -> ``input_norm`` / ``post_attn_norm``;
    ``hidden_norm.weight`` -> ``ctx_norm``; ``markov_head.markov_w1`` / ``markov_w2`` -> ``w1`` / ``w2``;
    ``markov_head.gate_proj`` -> ``gate``; ``markov_head.joint_proj`` -> ``joint``; ``confidence_head.proj`` ->
    ``conf``. EAGLE-3: ``layers.0.hidden_norm`` / ``layers.0.input_layernorm`` -> ``state_norm`` / ``embed_norm``,
    the layer's other tensors as above under ``layer.``. ``embed_tokens.weight`` and ``lm_head.weight`` (the
    target's, copied by the reference's trainer) are optional: when present the drafter uses its own, else the
    target's.

Draft vocabulary (vLLM's reading of the format): with ``draft_vocab_size`` V' < V, ``lm_head`` is [V', Dm],
``markov_head.markov_w2`` is [V', r] and ``d2t`` [V'] int64 holds offsets, token id = i + d2t[i]; ``t2d`` [V] bool
(training only) marks the draft ids. They load as ``DSparkDrafter.set_draft_vocab`` (DSpark / DFlash only).
A ``mask_embedding`` tensor, a placeholder some DSpark checkpoints carry, is not used (the mask positions take the
embedding row of ``mask_token_id``; vLLM skips it as well).

Beside the weights, an export writes this project's confidence calibration (``dspark_calibration.json``, per-position
temperatures of the confidence logits) and, when given, the throughput profile (``dspark_cost_table.json``, the
schema of ``app/scheduling/profile.py``); loading reads the calibration back when present.

Usage::

    python -m app.drafters.deepspec export CHECKPOINT OUT [--target MODEL] [--profile PROFILE.json]
        [--dtype bfloat16]

Shape symbols: V vocab, V' draft vocabulary, Dm hidden, r Markov rank.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from app.drafters.calibration import Calibration
from app.drafters.config import DrafterConfig, EagleConfig
from app.drafters.dspark import DSparkDrafter, check_draft_vocab
from app.drafters.eagle import EagleDrafter

WEIGHTS, CONFIG = "model.safetensors", "config.json"
CALIBRATION, COST_TABLE = "dspark_calibration.json", "dspark_cost_table.json"
DSPARK, EAGLE3 = "Qwen3DSparkModel", "Qwen3Eagle3Model"
ARCHITECTURES = (DSPARK, EAGLE3)
HEADS = {"vanilla": "markov", "gated": "gated", "rnn": "joint_rnn"}  # markov_head_type -> DrafterConfig.head
UNSPECIFIED_TARGET = "unspecified (DeepSpec checkpoint)"
OPTIONAL = ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d", "mask_embedding")


def is_deepspec_config(doc: dict) -> bool:
    """Whether a parsed ``config.json`` is in DeepSpec's format (it names ``architectures``) rather than this
    project's (``{kind, config, ...}``)."""
    return isinstance(doc, dict) and "architectures" in doc and "config" not in doc


def _field(hf: dict, name: str, where: str):
    if name not in hf:
        raise ValueError(f"{where}: DeepSpec config field {name!r} is missing")
    return hf[name]


def drafter_config(hf: dict, *, where: str = CONFIG) -> DrafterConfig | EagleConfig:
    """This project's config for a DeepSpec ``config.json`` (parsed), ``where`` naming it in errors:
    ``DrafterConfig`` for ``Qwen3DSparkModel``, ``EagleConfig`` for ``Qwen3Eagle3Model``.

    Raises:
        ValueError: an unsupported architecture, activation, attention bias, rotary type, sliding-window layer,
        Markov head type, target layer id or EAGLE-3 layer count, or a missing field (the message names it).
    """
    arch = _field(hf, "architectures", where)
    if not isinstance(arch, list) or len(arch) != 1 or arch[0] not in ARCHITECTURES:
        raise ValueError(f"{where}: architectures {arch!r} is not a supported DeepSpec drafter; expected one of "
                         f"{list(ARCHITECTURES)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
    if hf.get("attention_bias", False):
        raise ValueError(f"{where}: attention_bias true is not supported")
    layer_types = hf.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"{where}: layer_types {layer_types} has a layer other than 'full_attention'")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"{where}: rotary type {rope.get('rope_type', rope.get('type'))!r} is not supported "
                         "(only 'default')")
    theta = rope.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise ValueError(f"{where}: DeepSpec config field 'rope_theta' (or rope_parameters.rope_theta) is missing")
    layer_ids = list(_field(hf, "target_layer_ids", where))
    if any(i < 0 for i in layer_ids):
        raise ValueError(f"{where}: target_layer_ids {layer_ids} holds -1 (the embedding output), which is not a "
                         "feature layer of this engine")
    hidden = int(_field(hf, "hidden_size", where))
    heads = int(_field(hf, "num_attention_heads", where))
    shape = {
        "target": hf.get("target_model_name_or_path") or UNSPECIFIED_TARGET, "hidden_size": hidden,
        "num_heads": heads, "num_kv_heads": _field(hf, "num_key_value_heads", where),
        "head_dim": hf.get("head_dim") or hidden // heads, "intermediate_size": _field(hf, "intermediate_size", where),
        "vocab_size": _field(hf, "vocab_size", where), "feature_layers": layer_ids, "target_hidden_size": hidden,
        "rms_norm_eps": _field(hf, "rms_norm_eps", where), "rope_theta": theta,
        "max_positions": _field(hf, "max_position_embeddings", where), "qk_norm": True, "feature_norm": False,
    }
    try:
        if arch[0] == EAGLE3:
            return _eagle_config(hf, shape, where)
        return _dspark_config(hf, shape, where)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from err


def _eagle_config(hf: dict, shape: dict, where: str) -> EagleConfig:
    layers = int(_field(hf, "num_hidden_layers", where))
    if layers != 1:
        raise ValueError(f"num_hidden_layers {layers}: only one EAGLE-3 draft layer is supported")
    return EagleConfig.model_validate({**shape, "block_size": _field(hf, "ttt_length", where),
                                       "fused_layers": shape["feature_layers"], "fusion": "concat",
                                       "confidence": False})


def _dspark_config(hf: dict, shape: dict, where: str) -> DrafterConfig:
    rank = int(_field(hf, "markov_rank", where))
    head = "none"
    if rank > 0:
        kind = str(_field(hf, "markov_head_type", where)).lower()
        if kind not in HEADS:
            raise ValueError(f"markov_head_type {kind!r} is not one of {sorted(HEADS)}")
        head = HEADS[kind]
    confidence = "none"
    if _field(hf, "enable_confidence_head", where):
        confidence = "hidden_prev" if _field(hf, "confidence_head_with_markov", where) else "hidden"
    fields = {**shape, "block_size": _field(hf, "block_size", where),
              "num_layers": _field(hf, "num_hidden_layers", where), "head": head,
              "mask_token_id": _field(hf, "mask_token_id", where), "confidence": confidence}
    if rank > 0:
        fields["rank"] = rank
    return DrafterConfig.model_validate(fields)


def _layer_map(c: DrafterConfig | EagleConfig, ours: str, ref: str) -> list[tuple[str, list[str], list[int]]]:
    """``tensor_map`` entries of one Qwen3 decoder layer (without its input norm): ours / ref are the prefixes."""
    q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    a, m = f"{ref}.self_attn.", f"{ref}.mlp."
    return [
        (f"{ours}.qkv.weight", [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"], [q, kv, kv]),
        (f"{ours}.o_proj.weight", [a + "o_proj.weight"], [c.hidden_size]),
        (f"{ours}.q_norm", [a + "q_norm.weight"], [c.head_dim]),
        (f"{ours}.k_norm", [a + "k_norm.weight"], [c.head_dim]),
        (f"{ours}.gate_up.weight", [m + "gate_proj.weight", m + "up_proj.weight"], [inter, inter]),
        (f"{ours}.down_proj.weight", [m + "down_proj.weight"], [c.hidden_size]),
        (f"{ours}.post_attn_norm", [f"{ref}.post_attention_layernorm.weight"], [c.hidden_size]),
    ]


def tensor_map(c: DrafterConfig | EagleConfig) -> list[tuple[str, list[str], list[int]]]:
    """(this project's state-dict key, the reference tensors whose rows it concatenates, their row counts) for
    every weight of a DeepSpec-format drafter of config ``c`` (full vocabulary)."""
    d = c.hidden_size
    out = [("fc.weight", ["fc.weight"], [d]), ("norm", ["norm.weight"], [d])]
    if isinstance(c, EagleConfig):
        return out + _layer_map(c, "layer", "layers.0") + [
            ("state_norm", ["layers.0.hidden_norm.weight"], [d]),
            ("embed_norm", ["layers.0.input_layernorm.weight"], [d])]
    out.append(("ctx_norm", ["hidden_norm.weight"], [d]))
    for i in range(c.num_layers):
        out += _layer_map(c, f"layers.{i}", f"layers.{i}")
        out.append((f"layers.{i}.input_norm", [f"layers.{i}.input_layernorm.weight"], [d]))
    if c.head != "none":
        out += [("w1.weight", ["markov_head.markov_w1.weight"], [c.vocab_size]),
                ("w2.weight", ["markov_head.markov_w2.weight"], [c.vocab_size])]
    if c.head == "gated":
        out += [("gate.weight", ["markov_head.gate_proj.weight"], [c.rank]),
                ("gate.bias", ["markov_head.gate_proj.bias"], [c.rank])]
    if c.head == "joint_rnn":
        out += [("joint.weight", ["markov_head.joint_proj.weight"], [3 * c.rank]),
                ("joint.bias", ["markov_head.joint_proj.bias"], [3 * c.rank])]
    if c.confidence_input != "none":
        out += [("conf.weight", ["confidence_head.proj.weight"], [1]),
                ("conf.bias", ["confidence_head.proj.bias"], [1])]
    return out


def _check_shape(where: str, name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{where}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")


def _draft_vocab(tensors: dict, hf: dict, c: DrafterConfig | EagleConfig, where: str) -> torch.Tensor | None:
    """The draft vocabulary ids [V'] of ``draft_vocab_size`` < V (from ``d2t``, checked against ``t2d``), else
    None."""
    size = int(hf.get("draft_vocab_size") or c.vocab_size)
    if size < c.vocab_size and isinstance(c, EagleConfig):
        raise ValueError(f"{where}: draft_vocab_size {size} < vocab_size {c.vocab_size}: a draft vocabulary is "
                         f"supported for {DSPARK} only")
    if size >= c.vocab_size:
        if "d2t" in tensors:
            raise ValueError(f"{where}: tensor 'd2t' is present but draft_vocab_size {size} is not below vocab_size "
                             f"{c.vocab_size}")
        return None
    if "d2t" not in tensors:
        raise ValueError(f"{where}: draft_vocab_size {size} < vocab_size {c.vocab_size} needs tensor 'd2t'")
    _check_shape(where, "d2t", tensors["d2t"], (size,))
    try:
        ids = check_draft_vocab(torch.arange(size) + tensors["d2t"].long().cpu(), c.vocab_size)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: tensor 'd2t' does not map to sorted distinct token ids: {err}") from err
    if "t2d" in tensors and not torch.equal(tensors["t2d"].bool().cpu().nonzero().flatten(), ids):
        raise ValueError(f"{where}: tensor 't2d' does not mark the same token ids as 'd2t'")
    return ids


def load_deepspec(
    path: Path | str, embed_weight: torch.Tensor, *, head_weight: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[DSparkDrafter | EagleDrafter, Calibration, dict]:
    """Rebuild the DeepSpec-format drafter in folder ``path`` on ``embed_weight``'s device (``DSparkDrafter`` or
    ``EagleDrafter``, by its architecture).

    Args:
        embed_weight: [V, Dm] the target's input embedding, used when the folder has no ``embed_tokens.weight``.
        head_weight: [V, Dm] the target's LM head, used when the folder has no ``lm_head.weight`` (None: the
            folder must hold one).
        dtype: parameter dtype (None: the embedding's dtype).

    Returns:
        The drafter in eval mode (over its draft vocabulary when the folder has one), its calibration
        (``dspark_calibration.json``, identity without one), and metadata ``{"format": "deepspec", ...}``.

    Raises:
        FileNotFoundError: no ``config.json`` / ``model.safetensors``; ValueError: the config is not a supported
        DeepSpec drafter or not one for this target (vocabulary, hidden size), a tensor is missing, unexpected or
        of the wrong shape (the message names it).
    """
    path = Path(path)
    for name in (CONFIG, WEIGHTS):
        if not (path / name).is_file():
            raise FileNotFoundError(f"no DeepSpec drafter in {path}: {name} is missing")
    hf = json.loads((path / CONFIG).read_text())
    c = drafter_config(hf, where=str(path / CONFIG))
    if tuple(embed_weight.shape) != (c.vocab_size, c.hidden_size):
        raise ValueError(f"{path / CONFIG}: the drafter is for a target of vocab_size {c.vocab_size} and hidden_size "
                         f"{c.hidden_size}, but the target's embedding is {tuple(embed_weight.shape)}")
    where = str(path / WEIGHTS)
    tensors = load_file(where, device=str(embed_weight.device))
    entries = tensor_map(c)
    expected = {name for _, names, _ in entries for name in names}
    missing = sorted(expected - tensors.keys())
    if missing:
        raise ValueError(f"{where}: missing tensor(s) {missing}")
    unexpected = sorted(tensors.keys() - expected - set(OPTIONAL))
    if unexpected:
        raise ValueError(f"{where}: unexpected tensor(s) {unexpected}: not part of a {hf['architectures'][0]} with "
                         "this config (num_hidden_layers, markov_rank, markov_head_type, enable_confidence_head)")
    ids = _draft_vocab(tensors, hf, c, where)
    rows = c.vocab_size if ids is None else len(ids)  # rows of lm_head and markov_w2

    def full_vocab(name: str, width: int) -> torch.Tensor:
        t = tensors[name]
        _check_shape(where, name, t, (rows, width))
        return t if ids is None else t.new_zeros(c.vocab_size, width).index_copy_(0, ids.to(t.device), t)

    embed = tensors.get("embed_tokens.weight", embed_weight)
    if "embed_tokens.weight" in tensors:
        _check_shape(where, "embed_tokens.weight", embed, (c.vocab_size, c.hidden_size))
    if "lm_head.weight" in tensors:
        head = full_vocab("lm_head.weight", c.hidden_size)
    elif ids is not None or head_weight is None:
        raise ValueError(f"{where}: tensor 'lm_head.weight' is missing (needed with a draft vocabulary, or when the "
                         "target's LM head is not passed as head_weight)")
    else:
        head = head_weight
    drafter = (EagleDrafter if isinstance(c, EagleConfig) else DSparkDrafter)(c, embed, head)
    own = drafter.state_dict()
    state = {}
    for key, names, sizes in entries:
        parts = []
        for name, size in zip(names, sizes):
            if key == "w2.weight":
                parts.append(full_vocab(name, c.rank))
                continue
            _check_shape(where, name, tensors[name], (size, *own[key].shape[1:]))
            parts.append(tensors[name])
        state[key] = torch.cat(parts) if len(parts) > 1 else parts[0]
    drafter.load_state_dict(state, strict=True)
    drafter.to(device=embed_weight.device, dtype=dtype or embed_weight.dtype).eval()
    if ids is not None:
        drafter.set_draft_vocab(ids)
    calibration = Calibration()
    if (path / CALIBRATION).is_file():
        calibration = Calibration.from_json(json.loads((path / CALIBRATION).read_text()))
    return drafter, calibration, {"format": "deepspec", "architecture": hf["architectures"][0]}


def deepspec_config(
    c: DrafterConfig | EagleConfig, *, dtype: torch.dtype, draft_vocab_size: int | None = None
) -> dict:
    """The DeepSpec ``config.json`` (a dict) of a drafter of config ``c``.

    Raises:
        ValueError: ``c`` uses an option the format cannot express (the message names the field).
    """
    rules = [("qk_norm", c.qk_norm, "True (Qwen3 draft layers)"), ("feature_norm", not c.feature_norm, "False"),
             ("target_hidden_size", c.target_hidden_size == c.hidden_size, f"hidden_size {c.hidden_size}")]
    if isinstance(c, EagleConfig):
        rules += [("fusion", c.fusion == "concat", "'concat'"), ("confidence", not c.confidence, "False"),
                  ("fused_layers", c.fused_layers == c.feature_layers, f"feature_layers {c.feature_layers}")]
    else:
        rules += [("mask_token_id", c.mask_token_id is not None, "a token id"),
                  ("head", c.head in ("markov", "gated", "joint_rnn", "none"),
                   "'markov', 'gated', 'joint_rnn' or 'none'"),
                  ("confidence", c.confidence_input != "hidden_state", "not [h; s] (head 'rnn')")]
    for name, ok, need in rules:
        if not ok:
            raise ValueError(f"the DeepSpec format cannot express {name}={getattr(c, name)!r}; it needs {need}")
    shape = {
        "model_type": "qwen3", "dtype": str(dtype).removeprefix("torch."),
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"},
        "max_position_embeddings": c.max_positions, "hidden_act": "silu", "attention_bias": False,
        "attention_dropout": 0.0, "tie_word_embeddings": False, "target_layer_ids": list(c.feature_layers),
        "target_model_name_or_path": c.target,
    }
    if isinstance(c, EagleConfig):
        return {"architectures": [EAGLE3], **shape, "num_hidden_layers": 1, "draft_num_hidden_layers": 1,
                "layer_types": ["full_attention"], "ttt_length": c.block_size,
                "step_loss_decay": 0.8}  # a training knob; the reference's model constructor requires the field
    types = {v: k for k, v in HEADS.items()}
    hf = {
        "architectures": [DSPARK], **shape, "num_hidden_layers": c.num_layers,
        "layer_types": ["full_attention"] * c.num_layers, "block_size": c.block_size, "mask_token_id": c.mask_token_id,
        "markov_rank": 0 if c.head == "none" else c.rank, "enable_confidence_head": c.confidence_input != "none",
        "num_anchors": 512,  # a training knob; the reference's model constructor requires the field
    }
    if c.head != "none":
        hf["markov_head_type"] = types[c.head]
    if c.confidence_input != "none":
        hf["confidence_head_with_markov"] = c.confidence_input == "hidden_prev"
    if draft_vocab_size is not None:
        hf["draft_vocab_size"] = draft_vocab_size
    return hf


def export_deepspec(
    drafter: DSparkDrafter | EagleDrafter, out: Path | str, *, calibration: Calibration | None = None,
    profile: Path | str | None = None, dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write ``drafter`` to folder ``out`` in DeepSpec's format: ``config.json``, ``model.safetensors`` (weights cast to
    ``dtype``, with ``embed_tokens`` / ``lm_head`` from the drafter's embedding and LM head, and ``d2t`` / ``t2d``
    plus the draft-vocabulary rows of ``lm_head`` and ``markov_w2`` when it has a draft vocabulary),
    ``dspark_calibration.json`` and, with ``profile``, the validated throughput profile as ``dspark_cost_table.json``
    (without it, a cost table an earlier export left in ``out`` is removed). The profile is read before anything is
    written.

    Returns:
        ``out``.

    Raises:
        ValueError: the drafter uses an option the format cannot express (``deepspec_config``);
        pydantic.ValidationError: ``profile`` does not match the profile schema.
        FileNotFoundError: no file at ``profile``.
    """
    from app.scheduling.profile import load_profile, save_profile

    table = load_profile(profile) if profile is not None else None
    c = drafter.config
    ids = drafter.draft_vocab if isinstance(drafter, DSparkDrafter) else None
    hf = deepspec_config(c, dtype=dtype, draft_vocab_size=None if ids is None else len(ids))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = drafter.state_dict()
    tensors = {"embed_tokens.weight": drafter.embed_weight, "lm_head.weight": drafter.lm_head}
    for key, names, sizes in tensor_map(c):
        tensors.update(zip(names, state[key].split(sizes)))
    if ids is not None:
        tensors["lm_head.weight"] = drafter.lm_head.index_select(0, ids)
        if c.head != "none":
            tensors["markov_head.markov_w2.weight"] = state["w2.weight"].index_select(0, ids)
    tensors = {k: v.detach().to(dtype).cpu().clone() for k, v in tensors.items()}  # clone: tied heads share memory
    if ids is not None:
        tensors["d2t"] = (ids - torch.arange(len(ids), device=ids.device)).cpu().contiguous()
        tensors["t2d"] = torch.zeros(c.vocab_size, dtype=torch.bool).index_fill_(0, ids.cpu(), True)
    save_file(tensors, str(out / WEIGHTS))
    (out / CONFIG).write_text(json.dumps(hf, indent=2) + "\n")
    (out / CALIBRATION).write_text(json.dumps((calibration or Calibration()).to_json(), indent=2) + "\n")
    if table is not None:
        save_profile(table, out / COST_TABLE)
    else:
        (out / COST_TABLE).unlink(missing_ok=True)  # an earlier export's, which would describe another drafter
    return out


def main(argv: list[str] | None = None) -> None:
    """CLI: ``export CHECKPOINT OUT``: a drafter checkpoint of this project to DeepSpec's format, on the embedding
    and LM head of its target (``--target``, default: the checkpoint's ``target``). A checkpoint that is missing, of
    an unknown kind or with a config the format cannot express exits with status 2 and the reason, before the
    target is loaded."""
    p = argparse.ArgumentParser(prog="python -m app.drafters.deepspec", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="write a drafter checkpoint of this project in DeepSpec's format")
    e.add_argument("checkpoint", help="folder of a DSpark / DFlash / EAGLE-3 checkpoint of this project")
    e.add_argument("out", help="output folder")
    e.add_argument("--target", help="target model (embedded name, local dir, HF id); default: the checkpoint's")
    e.add_argument("--profile", help="throughput profile JSON to ship beside it as dspark_cost_table.json")
    e.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = p.parse_args(argv)
    # checkpoint.py dispatches DeepSpec folders to this module, so it is imported here, not at the top
    from app.drafters.checkpoint import KINDS, load_checkpoint, read_checkpoint_config
    from app.engine.config import EngineConfig
    from app.engine.engine import TargetEngine

    dtype = getattr(torch, args.dtype)
    try:
        doc = read_checkpoint_config(args.checkpoint)
        kind = doc.get("kind", "dspark")
        if kind not in KINDS:
            raise ValueError(f"checkpoint {args.checkpoint}: unknown drafter kind {kind!r}; expected {sorted(KINDS)}")
        deepspec_config(KINDS[kind][0].model_validate(doc["config"]), dtype=dtype)  # refuse before loading the target
    except (FileNotFoundError, ValueError) as err:  # pydantic's ValidationError is a ValueError
        e.error(str(err))
    target = args.target or doc["config"]["target"]
    if args.profile is not None:
        from app.scheduling.profile import load_profile, model_matches

        try:
            measured_for = load_profile(args.profile).provenance.model
        except (FileNotFoundError, ValueError) as err:
            e.error(f"--profile: {err}")
        if not model_matches(measured_for, target):
            print(f"warning: --profile {args.profile} was measured for {measured_for!r}, the drafter's target is "
                  f"{target!r}: its costs are another model's", file=sys.stderr)
    model = TargetEngine(EngineConfig(model=target, max_num_seqs=1, max_model_len=64)).model
    drafter, calibration, _ = load_checkpoint(args.checkpoint, model.embed_tokens.weight,
                                              head_weight=model.lm_head.weight, dtype=torch.float32)
    out = export_deepspec(drafter, args.out, calibration=calibration, profile=args.profile, dtype=dtype)
    print(json.dumps({"exported": str(out), "config": str(out / CONFIG)}))


if __name__ == "__main__":
    main()
