"""The demo CLI refuses bad flags with a usage error naming the value, before any decoding."""

from __future__ import annotations

import pytest

from app.demo import main


@pytest.mark.parametrize("flags, message", [
    (["--max-tokens", "0"], "argument --max-tokens: expected an integer >= 1, got 0"),
    (["--model", "no-such-model"], "--model: model 'no-such-model' is neither an embedded model"),
])
def test_bad_flags_are_usage_errors(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_:
        main(flags)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
