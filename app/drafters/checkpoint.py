"""Drafter checkpoints: ``model.safetensors`` (drafter weights only) + ``config.json`` (DrafterConfig,
calibration, training metadata). Loading reads local files only and takes the target's embedding from the
caller; the shared embedding / LM head is never stored.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from app.drafters.calibration import Calibration
from app.drafters.config import DrafterConfig
from app.drafters.dspark import DSparkDrafter

WEIGHTS, CONFIG = "model.safetensors", "config.json"


def save_checkpoint(
    path: Path | str,
    drafter: DSparkDrafter,
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
        "config": drafter.config.model_dump(mode="json"),
        "calibration": (calibration or Calibration()).to_json(),
        "weights_dtype": str(dtype).removeprefix("torch."),
        "metadata": metadata or {},
    }
    (path / CONFIG).write_text(json.dumps(doc, indent=2) + "\n")


def load_checkpoint(
    path: Path | str, embed_weight: torch.Tensor, *, dtype: torch.dtype | None = None
) -> tuple[DSparkDrafter, Calibration, dict]:
    """Rebuild a drafter from ``path`` on ``embed_weight``'s device.

    Args:
        embed_weight: [V, Dm] the target's tied embedding (shared, frozen).
        dtype: parameter dtype (None: the embedding's dtype).

    Returns:
        The drafter in eval mode, its calibration, and the checkpoint's metadata.

    Raises:
        FileNotFoundError: missing files; ValueError: a config that does not validate or match the weights.
    """
    path = Path(path)
    doc = json.loads((path / CONFIG).read_text())
    config = DrafterConfig.model_validate(doc["config"])
    drafter = DSparkDrafter(config, embed_weight)
    state = load_file(str(path / WEIGHTS), device=str(embed_weight.device))
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not match its config: missing {missing}, unexpected {unexpected}")
    drafter.to(dtype or embed_weight.dtype).eval()
    return drafter, Calibration.from_json(doc.get("calibration", {})), doc.get("metadata", {})
