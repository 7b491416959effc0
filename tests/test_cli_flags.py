"""The demo, benchmark and profiling command lines refuse bad flags with a usage error naming them (exit 2), before any
timing: no traceback from inside a run, no run over nothing."""

from __future__ import annotations

import importlib

import pytest

CASES = [
    ("app.demo", ["--max-tokens", "0"], "argument --max-tokens: expected an integer >= 1, got 0"),
    ("app.demo", ["--model", "no-such-model"], "--model: model 'no-such-model' is neither an embedded model"),
    ("app.scheduling.profiler", ["--batch-sizes", "1,x"], "argument --batch-sizes: expected an integer, got 'x'"),
    ("app.scheduling.profiler", ["--tokens-per-request", "2,2"], "argument --tokens-per-request: 2 given more"),
    ("app.scheduling.profiler", ["--repeats", "0"], "argument --repeats: expected an integer >= 1, got 0"),
    ("app.scheduling.profiler", ["--model", "no-such-model"], "the engine refuses these flags: model 'no-such-model'"),
    ("app.engine.bench_prefill", ["--budgets", "0"], "argument --budgets: expected an integer >= 1, got 0"),
    ("app.engine.bench_prefill", ["--arrive-after", "47"], "--arrive-after 47: the long prompt must arrive while"),
    ("app.engine.bench_prefill", ["--temperature", "-1"], "argument --temperature: expected a number >= 0"),
    ("app.engine.bench_prefill", ["--budgets", "10,512"], "--budgets 10: each budget must admit the"),
    ("app.engine.bench_prefill", ["--prompt-tokens", "2041"],
     "--prompt-tokens 2041: prompt of 2041 tokens + max_tokens 8 = 2049 exceeds the context limit of 2048 tokens"),
    ("app.scheduling.profiler", ["--tokens-per-request", "2,4"],
     "--batch-sizes / --tokens-per-request: tokens_per_request must start at 1 (plain decoding), got 2"),
    ("app.drafters.bench", ["--context", "1920", "--batches", "1"], "--context 1920 / --repeats 15: prompt of 1920"),
    ("app.engine.bench_controls", ["--prompts", "0"], "argument --prompts: expected an integer >= 1, got 0"),
    ("app.engine.bench_controls", ["--prompts", "7"], "--prompts 7: there are 6 prompts per control"),
    ("app.drafters.bench", ["--batches", "1", "0"], "argument --batches: expected an integer >= 1, got 0"),
    ("app.drafters.bench", ["--repeats", "0"], "argument --repeats: expected an integer >= 1, got 0"),
    ("app.eval.compare", ["--ngram", "--ngram-min", "5", "--ngram-max", "2"], "--ngram-min 5 is above --ngram-max 2"),
    ("app.eval.compare", ["--ngram", "--model", "no-such-model"], "refuses these flags: model 'no-such-model' is"),
]


@pytest.mark.parametrize(("module", "flags", "message"), CASES, ids=[f"{m}{' '.join(f)}" for m, f, _ in CASES])
def test_bad_flags_are_usage_errors(capsys, module, flags, message):
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(module).main(flags)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err, err
