"""The wire messages between deployments: what a drafter call carries (no Ray, no weights)."""

from __future__ import annotations

import pickle

import torch

from app.engine.types import FinishReason, StepOutput
from app.loop import DraftCall
from app.serving.protocol import strip_for_drafter


def _outputs(batch: int, rows: int, width: int) -> list[StepOutput]:
    """Step outputs whose features are row views of one [batch * rows, width] tensor, as the engine hands out."""
    step = torch.randn(batch * rows, width).to(torch.bfloat16)
    return [StepOutput(request_id=f"r{i}", new_token_ids=[i, i + 1], num_draft=rows - 1, num_accepted=1,
                       text="dropped", features=step[i * rows : i * rows + 2])
            for i in range(batch)]


def test_strip_keeps_what_the_drafter_reads_and_drops_text():
    (out,) = _outputs(1, 8, 16)
    out = StepOutput(**{**out.__dict__, "finished": True, "finish_reason": FinishReason.STOP})
    stripped = strip_for_drafter(out)
    assert stripped.text == ""
    assert (stripped.request_id, stripped.new_token_ids, stripped.num_draft, stripped.num_accepted,
            stripped.finished, stripped.finish_reason) == ("r0", [0, 1], 7, 1, True, FinishReason.STOP)
    assert torch.equal(stripped.features, out.features)


def test_drafter_call_carries_each_request_rows_once_not_the_whole_step():
    batch, rows, width = 16, 8, 256
    outputs = _outputs(batch, rows, width)
    kept_bytes = sum(o.features.numel() * o.features.element_size() for o in outputs)  # 2 rows each
    whole_step_bytes = batch * rows * width * 2
    payload = len(pickle.dumps(DraftCall(updates=[strip_for_drafter(o) for o in outputs])))
    assert payload < kept_bytes + 1024 * batch  # the rows plus a little framing per request
    assert payload < whole_step_bytes  # and far from one copy of the whole step per request


def test_stripped_features_survive_the_wire():
    (out,) = _outputs(1, 8, 16)
    (back,) = pickle.loads(pickle.dumps(DraftCall(updates=[strip_for_drafter(out)]))).updates
    assert back.features.shape == (2, 16) and torch.equal(back.features, out.features)
