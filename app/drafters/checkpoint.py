"""Drafter checkpoints: ``model.safetensors`` (drafter weights only) + ``config.json`` (kind, config,
calibration, training metadata). Loading reads local files only, dispatches on the ``kind`` field ("dspark", the
default of checkpoints written before kinds existed, also covers DFlash-style ``head="none"``; "eagle" covers
EAGLE-3-style and MTP-1) and takes the target's embedding from the caller; the shared embedding / LM head is
never stored.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from app.drafters.calibration import Calibration
from app.drafters.config import DrafterConfig, EagleConfig
from app.drafters.dspark import DSparkDrafter
from app.drafters.eagle import EagleDrafter

WEIGHTS, CONFIG = "model.safetensors", "config.json"
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
    """Write the drafter's own weights (cast to ``dtype``) and its config / calibration / metadata JSON."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous() for k, v in drafter.state_dict().items()}
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
    """The parsed ``config.json`` of the checkpoint folder ``path`` (kind, config, calibration, metadata).

    Raises:
        FileNotFoundError: no ``config.json`` in ``path``; ValueError: the file is not JSON, or has no ``config``
        object naming its ``target``.
    """
    file = Path(path) / CONFIG
    if not file.is_file():
        raise FileNotFoundError(f"no drafter checkpoint in {path}: {CONFIG} is missing")
    try:
        doc = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("config"), dict) or "target" not in doc["config"]:
        raise ValueError(f"{file} has no 'config' object with a 'target' field")
    return doc


def load_checkpoint(
    path: Path | str, embed_weight: torch.Tensor, *, dtype: torch.dtype | None = None
) -> tuple[Drafter, Calibration, dict]:
    """Rebuild a drafter of the checkpoint's kind from ``path`` on ``embed_weight``'s device.

    Args:
        embed_weight: [V, Dm] the target's tied embedding (shared, frozen).
        dtype: parameter dtype (None: the embedding's dtype).

    Returns:
        The drafter in eval mode, its calibration, and the checkpoint's metadata.

    Raises:
        FileNotFoundError: missing files; ValueError: an unknown kind, or a config that does not validate or
        match the weights.
    """
    path = Path(path)
    doc = read_checkpoint_config(path)
    kind = doc.get("kind", "dspark")
    if kind not in KINDS:
        raise ValueError(f"checkpoint {path}: unknown drafter kind {kind!r}; expected one of {sorted(KINDS)}")
    config_cls, drafter_cls = KINDS[kind]
    drafter = drafter_cls(config_cls.model_validate(doc["config"]), embed_weight)
    state = load_file(str(path / WEIGHTS), device=str(embed_weight.device))
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match its config: missing {missing}, unexpected {unexpected}")
    drafter.to(device=embed_weight.device, dtype=dtype or embed_weight.dtype).eval()
    return drafter, Calibration.from_json(doc.get("calibration", {})), doc.get("metadata", {})
