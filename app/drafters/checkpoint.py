"""Drafter checkpoints: ``model.safetensors`` (drafter weights only) + ``config.json`` (kind, config,
calibration, training metadata). Loading reads local files only, dispatches on the ``kind`` field ("dspark", the
default of checkpoints written before kinds existed, also covers DFlash-style ``head="none"``; "eagle" covers
EAGLE-3-style and MTP-1) and takes the target's embedding from the caller; the shared embedding / LM head is
never stored.

A DSpark checkpoint may hold a draft vocabulary: the int64 tensor ``draft_vocab`` [V'] in ``model.safetensors``
(``DSparkDrafter.set_draft_vocab``; written by ``app.drafters.train.draft_vocab``). Loading validates it and
restricts drafting to it; a checkpoint without it drafts over the full vocabulary.

A folder in DeepSpec's format (DeepSeek's reference code: a ``config.json`` naming ``architectures``) loads through
the same functions (``deepspec.py``): ``read_checkpoint_config`` returns its translated config with
``"format": "deepspec"``, ``load_checkpoint`` maps its tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from app.drafters.calibration import Calibration
from app.drafters.config import DrafterConfig, EagleConfig
from app.drafters.deepspec import drafter_config, is_deepspec_config, load_deepspec
from app.drafters.dspark import DSparkDrafter, check_draft_vocab
from app.drafters.eagle import EagleDrafter

WEIGHTS, CONFIG = "model.safetensors", "config.json"
DEFAULT_CHECKPOINT = Path(__file__).resolve().parents[2] / "checkpoints" / "dspark-smollm2-135m"  # the committed one
DRAFT_VOCAB = "draft_vocab"  # the optional [V'] int64 tensor beside the weights
Drafter = DSparkDrafter | EagleDrafter
# kind -> (config class, module class)
KINDS: dict[str, tuple[type, type]] = {"dspark": (DrafterConfig, DSparkDrafter), "eagle": (EagleConfig, EagleDrafter)}


def kind_of(drafter: Drafter) -> str:
    """The ``kind`` name of a drafter module.

    Raises:
        TypeError: not a drafter class of ``KINDS``.
    """
    for kind, (_, cls) in KINDS.items():
        if type(drafter) is cls:
            return kind
    raise TypeError(f"{type(drafter).__name__} is not a drafter kind ({sorted(KINDS)})")


def save_checkpoint(
    path: Path | str,
    drafter: Drafter,
    *,
    calibration: Calibration | None = None,
    metadata: dict | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> None:
    """Write the drafter's own weights (cast to ``dtype``), its draft vocabulary if it has one (int64), and its
    config / calibration / metadata JSON."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous() for k, v in drafter.state_dict().items()}
    if isinstance(drafter, DSparkDrafter) and drafter.draft_vocab is not None:
        state[DRAFT_VOCAB] = drafter.draft_vocab.cpu().contiguous()
    save_file(state, str(path / WEIGHTS))
    doc = {
        "kind": kind_of(drafter),
        "config": drafter.config.model_dump(mode="json"),
        "calibration": (calibration or Calibration()).to_json(),
        "weights_dtype": str(dtype).removeprefix("torch."),
        "metadata": metadata or {},
    }
    (path / CONFIG).write_text(json.dumps(doc, indent=2) + "\n")


def read_checkpoint_config(path: Path | str) -> dict:
    """The parsed ``config.json`` of the checkpoint folder ``path`` (kind, config, calibration, metadata); for a
    DeepSpec-format folder, its translation: kind "dspark" or "eagle", the config fields, ``"format": "deepspec"``
    (its calibration is read by ``load_checkpoint``).

    Raises:
        FileNotFoundError: no ``config.json`` in ``path``; ValueError: the file is not JSON, has no ``config``
        object naming its ``target``, or is a DeepSpec config that ``deepspec.drafter_config`` rejects.
    """
    file = Path(path) / CONFIG
    if not file.is_file():
        raise FileNotFoundError(f"no drafter checkpoint in {path}: {CONFIG} is missing")
    try:
        doc = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    if is_deepspec_config(doc):
        config = drafter_config(doc, where=str(file))
        kind = "eagle" if isinstance(config, EagleConfig) else "dspark"
        return {"kind": kind, "config": config.model_dump(mode="json"), "metadata": {}, "format": "deepspec"}
    if not isinstance(doc, dict) or not isinstance(doc.get("config"), dict) or "target" not in doc["config"]:
        raise ValueError(f"{file} has no 'config' object with a 'target' field")
    return doc


def load_checkpoint(
    path: Path | str, embed_weight: torch.Tensor, *, head_weight: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[Drafter, Calibration, dict]:
    """Rebuild a drafter of the checkpoint's kind from ``path`` (this project's format or DeepSpec's) on
    ``embed_weight``'s device.

    Args:
        embed_weight: [V, Dm] the target's embedding (shared, frozen; the LM head too without ``head_weight``).
        head_weight: [V, Dm] the target's LM head when it is not tied to the embedding (a DeepSpec folder's own
            ``lm_head`` takes precedence).
        dtype: parameter dtype (None: the embedding's dtype).

    Returns:
        The drafter in eval mode (drafting over the checkpoint's draft vocabulary if it has one), its
        calibration, and the checkpoint's metadata.

    Raises:
        FileNotFoundError: missing files; ValueError: an unknown kind, a config that does not validate or
        match the weights, a draft vocabulary that is not sorted distinct ids in [0, V) or not on a DSpark
        drafter, or a DeepSpec folder that ``load_deepspec`` rejects
        (the message names the missing or mismatching tensor or field).
    """
    path = Path(path)
    doc = read_checkpoint_config(path)
    if doc.get("format") == "deepspec":
        return load_deepspec(path, embed_weight, head_weight=head_weight, dtype=dtype)
    kind = doc.get("kind", "dspark")
    if kind not in KINDS:
        raise ValueError(f"checkpoint {path}: unknown drafter kind {kind!r}; expected one of {sorted(KINDS)}")
    config_cls, drafter_cls = KINDS[kind]
    drafter = drafter_cls(config_cls.model_validate(doc["config"]), embed_weight, head_weight)
    state = load_file(str(path / WEIGHTS), device=str(embed_weight.device))
    draft_vocab = state.pop(DRAFT_VOCAB, None)
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match its config: missing {missing}, unexpected {unexpected}")
    drafter.to(device=embed_weight.device, dtype=dtype or embed_weight.dtype).eval()
    if draft_vocab is not None:
        if kind != "dspark":
            raise ValueError(f"checkpoint {path}: a {DRAFT_VOCAB} tensor is only supported for kind 'dspark', "
                             f"not {kind!r}")
        try:
            drafter.set_draft_vocab(draft_vocab)
        except (TypeError, ValueError) as err:
            raise ValueError(f"checkpoint {path}: {err}") from err
    return drafter, Calibration.from_json(doc.get("calibration", {})), doc.get("metadata", {})


def write_draft_vocab(path: Path | str, ids: torch.Tensor, *, info: dict) -> None:
    """Store the draft vocabulary ``ids`` [V'] in the DSpark checkpoint at ``path`` (replacing any it has) and
    record ``info`` under ``metadata.draft_vocab`` in its ``config.json``; the weights are left as they are.

    Raises:
        FileNotFoundError: missing files; ValueError: not a DSpark checkpoint; TypeError / ValueError: ``ids``
        not sorted distinct integer ids in [0, V) of the checkpoint's config.
    """
    path = Path(path)
    doc = json.loads((path / CONFIG).read_text())
    if doc.get("kind", "dspark") != "dspark":
        raise ValueError(f"checkpoint {path}: a draft vocabulary needs kind 'dspark', not {doc['kind']!r}")
    ids = check_draft_vocab(ids, DrafterConfig.model_validate(doc["config"]).vocab_size)
    state = load_file(str(path / WEIGHTS))
    state[DRAFT_VOCAB] = ids.cpu().contiguous()
    tmp = path / (WEIGHTS + ".tmp")
    save_file(state, str(tmp))
    tmp.replace(path / WEIGHTS)
    doc.setdefault("metadata", {})[DRAFT_VOCAB] = info
    (path / CONFIG).write_text(json.dumps(doc, indent=2) + "\n")
