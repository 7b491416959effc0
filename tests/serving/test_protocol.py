"""The wire messages between deployments: what a drafter call carries (no Ray, no weights)."""

from __future__ import annotations

import pickle

import torch

from app.engine.types import DraftBlock, FinishReason, SamplingParams, StepOutput
from app.loop import DraftCall, DraftRound, DraftStart
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


def test_a_drafter_call_and_its_answer_cross_the_wire_as_one_buffer_each():
    """Hundreds of per-request features (a call after rounds without drafting) pickle as one array, not one
    ``torch.save`` per tensor, and come back equal, absent features included."""
    outputs = [strip_for_drafter(o) for o in _outputs(16, 1, 64)] * 30
    outputs[3] = StepOutput(request_id="r3", new_token_ids=[5], features=None)
    first = StepOutput(request_id="s", new_token_ids=[9], features=torch.randn(12, 64).to(torch.bfloat16))
    call = DraftCall(starts=[DraftStart("s", [1, 2], first, SamplingParams(temperature=0.7, seed=3))],
                     updates=outputs, finished=["x"], propose=["s", "r0"])
    wire = pickle.dumps(call)
    assert b"_rebuild_tensor" not in wire
    back = pickle.loads(wire)
    assert (back.finished, back.propose, back.starts[0].prompt_ids, back.starts[0].params) == (
        ["x"], ["s", "r0"], [1, 2], call.starts[0].params)
    assert torch.equal(back.starts[0].first.features, first.features)
    for out, got in zip(outputs, back.updates, strict=True):
        assert (got.request_id, got.new_token_ids) == (out.request_id, out.new_token_ids)
        assert (got.features is None) == (out.features is None)
        assert out.features is None or torch.equal(got.features, out.features)
    blocks = [DraftBlock("a", torch.arange(7), torch.rand(7, 4), None, torch.randint(0, 99, (7, 4))),
              DraftBlock("b", torch.arange(3), verify_len=2)]
    answer = DraftRound(blocks, torch.rand(2, 7), missing=["c"], drafter_ms=1.5)
    wire = pickle.dumps(answer)
    assert b"_rebuild_tensor" not in wire
    got = pickle.loads(wire)
    assert (got.missing, got.drafter_ms, torch.equal(got.confidences, answer.confidences)) == (["c"], 1.5, True)
    for b, g in zip(blocks, got.blocks, strict=True):
        assert (g.request_id, g.verify_len) == (b.request_id, b.verify_len)
        for name in ("tokens", "probs", "prob_ids"):
            x, y = getattr(b, name), getattr(g, name)
            assert (x is None and y is None) or torch.equal(x, y)
