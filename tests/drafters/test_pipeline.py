"""The whole drafter recipe (``app.pipeline``) end to end on a tiny random Llama target.

No real weights: a 5-layer, 64-wide Llama and a 300-token byte-level BPE tokenizer are built in a temporary folder,
so the test runs in seconds on a CPU and, on a machine with a GPU, exercises every stage on CUDA (device auto).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from app.drafters.checkpoint import load_checkpoint
from app.drafters.lookup import read_lookup_rates
from app import pipeline
from app.engine.loader import load_target

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_target(folder) -> None:
    """A random transformers Llama checkpoint with its own tiny tokenizer in ``folder``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    text = [f"What is {i} plus {i + 3}? The answer is {2 * i + 3}." for i in range(200)]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                         tie_word_embeddings=True, eos_token_id=fast.eos_token_id, bos_token_id=fast.bos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)


def prompt_files(folder) -> None:
    """Every prompt file the training and evaluation sets name, a few short prompts each."""
    folder.mkdir()
    lines = {
        "gsm8k.jsonl": [f"What is {i} plus 3?" for i in range(705)],  # lines 1-700 train, 701+ evaluation
        "math500.jsonl": ["Solve 2x = 4."] * 4,
        "mbpp.jsonl": ["Write a function that adds two numbers."] * 4,
        "mt-bench.jsonl": ["Tell me about the sea."] * 4,
        "humaneval.jsonl": ["def add(a, b):"] * 4,
    }
    for name, prompts in lines.items():
        (folder / name).write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in prompts))


def test_pipeline_writes_a_calibrated_checkpoint_and_report(tmp_path, monkeypatch):
    tiny_target(tmp_path / "target")
    prompt_files(tmp_path / "datasets")
    out = tmp_path / "run"
    drafter_config = {"num_layers": 1, "intermediate_size": 64, "rank": 8, "block_size": 4}
    monkeypatch.chdir(tmp_path)  # --model as a relative path: the data and the checkpoint record it absolute
    pipeline.main([
        "--out", str(out), "--model", "target", "--datasets-dir", str(tmp_path / "datasets"),
        "--per-set", "gsm8k-train=6", "mbpp=2", "chat=2", "--max-tokens", "12", "--max-batch", "4",
        "--samples", "2", "--temperature", "1.0", "--config", json.dumps(drafter_config), "--steps", "4",
        "--train-minutes", "5", "--batch-seqs", "2", "--anchors", "4", "--eval-limit", "2", "--eval-max-tokens", "8",
        "--draft-vocab", "64",
    ])
    assert json.loads((out / "data-greedy" / "meta.json").read_text())["sequences"] == 10
    assert json.loads((out / "data-sampled" / "meta.json").read_text())["sequences"] == 20
    doc = json.loads((out / "checkpoint" / "config.json").read_text())
    assert json.loads((out / "data-greedy" / "meta.json").read_text())["model"] == str(tmp_path / "target")
    assert doc["config"]["target"] == str(tmp_path / "target")
    assert doc["metadata"]["train"]["steps_done"] == 4
    assert len(doc["calibration"]["temperatures"]["greedy"]) == 4
    assert doc["metadata"]["draft_vocab"]["size"] == 64
    target = load_target(str(tmp_path / "target"), device="cpu").model
    drafter, calibration, _ = load_checkpoint(out / "checkpoint", target.embed_tokens.weight)
    assert drafter.config.block_size == 4 and calibration is not None and drafter.draft_vocab.numel() == 64
    assert list(out.glob("eval/*.json")) and list(out.glob("eval/*.md"))
    assert json.loads((out / "eval-lookup" / "report.json").read_text())["rows"][0]["lookup_share"] is not None
    rates = read_lookup_rates(out / "checkpoint")
    assert set(rates.rates) == {"greedy", "sampled"} and rates.block_size == 4
    assert list(json.loads((out / "pipeline.json").read_text())["seconds"]) == [
        "datagen-greedy", "datagen-sampled", "train", "draft-vocab", "calibrate", "lookup-table", "evaluate",
        "evaluate-lookup"]  # V' before calibrating
    assert doc["metadata"]["calibration"]["heldout_seqs"] > 0
    # --init continues from that checkpoint (continued training, as the committed checkpoint's stages)
    again = tmp_path / "again"
    pipeline.main([
        "--out", str(again), "--model", str(tmp_path / "target"), "--datasets-dir", str(tmp_path / "datasets"),
        "--per-set", "gsm8k-train=4", "--max-tokens", "12", "--max-batch", "4", "--samples", "0", "--steps", "2",
        "--batch-seqs", "2", "--anchors", "4", "--draft-vocab", "64", "--init", str(out / "checkpoint"),
    ])
    doc = json.loads((again / "checkpoint" / "config.json").read_text())
    assert doc["metadata"]["init_train"]["steps_done"] == 4 and doc["metadata"]["train"]["steps_done"] == 2


def test_trainer_init_takes_the_checkpoints_architecture_and_train_vocab_draft_needs_it(tmp_path, capsys):
    """--init alone continues a non-default architecture (no --config repeat); --train-vocab draft and a wrong
    --kind or missing --init are argparse errors before any model loads; the V' record is carried over."""
    from app.drafters.train import datagen, draft_vocab, trainer

    target_dir = tmp_path / "target"
    tiny_target(target_dir)
    prompt_files(tmp_path / "datasets")
    data = tmp_path / "data"
    datagen.main(["--out", str(data), "--model", str(target_dir), "--per-set", "gsm8k-train=4", "--max-tokens", "6",
                  "--shard-size", "4", "--max-batch", "4", "--datasets-dir", str(tmp_path / "datasets")])
    common = ["--data", str(data), "--model", str(target_dir), "--steps", "2", "--batch-seqs", "1", "--anchors", "2"]
    first = tmp_path / "first"
    trainer.main([*common, "--out", str(first), "--config", '{"block_size": 4, "num_layers": 1}'])
    draft_vocab.main(["--data", str(data), "--checkpoint", str(first), "--size", "64"])
    second = tmp_path / "second"
    trainer.main([*common, "--out", str(second), "--init", str(first), "--train-vocab", "draft"])
    doc = json.loads((second / "config.json").read_text())
    assert doc["config"]["block_size"] == 4 and doc["metadata"]["draft_vocab"]["size"] == 64
    assert doc["metadata"]["init_train"]["steps_done"] == 2
    for extra, message in [(["--train-vocab", "draft"], "--train-vocab draft"),
                           (["--init", str(tmp_path / "nowhere")], "--init"),
                           (["--init", str(first), "--kind", "eagle"], "--kind eagle")]:
        with pytest.raises(SystemExit) as exc:
            trainer.main([*common, "--out", str(tmp_path / "x"), *extra])
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_trainer_names_an_unknown_config_field(tmp_path, capsys):
    from app.drafters.train.trainer import main

    tiny_target(tmp_path / "target")
    (tmp_path / "shard-0000.safetensors").write_bytes(b"")  # never read: the config is refused first
    with pytest.raises(SystemExit) as exc:
        main(["--data", str(tmp_path), "--out", str(tmp_path / "ckpt"), "--model", str(tmp_path / "target"),
              "--config", '{"hed": "rnn"}'])
    assert exc.value.code == 2 and "hed" in capsys.readouterr().err


def assert_same_shard(a: dict, b: dict, label: str) -> None:
    """Two datagen shards hold the same sequences: tokens and offsets equal, features equal up to float rounding (a
    stopped and continued run batches other rows together, and a float32 matmul's row may round differently with the
    rows beside it: differences of ~1e-8 seen)."""
    assert a.keys() == b.keys(), label
    for name in a:
        if name == "features":
            torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{label}: {m}")
        else:
            assert torch.equal(a[name], b[name]), (label, name)


def test_datagen_first_shard_continues_a_stopped_run(tmp_path, capsys):
    """``--first-shard 1`` writes the second shard of the full run: same prompts, same answers, same file name."""
    from safetensors.torch import load_file

    from app.drafters.train import datagen

    tiny_target(tmp_path / "target")
    prompt_files(tmp_path / "datasets")
    common = ["--model", str(tmp_path / "target"), "--datasets-dir", str(tmp_path / "datasets"),
              "--per-set", "gsm8k-train=6", "--max-tokens", "6", "--shard-size", "2", "--max-batch", "2"]
    datagen.main(["--out", str(tmp_path / "full"), "--max-shards", "3", *common])
    datagen.main(["--out", str(tmp_path / "rest"), "--first-shard", "1", "--max-shards", "1", *common])
    assert sorted(p.name for p in (tmp_path / "rest").glob("*.safetensors")) == ["shard-0001.safetensors"]
    full, rest = (load_file(str(tmp_path / d / "shard-0001.safetensors")) for d in ("full", "rest"))
    assert_same_shard(full, rest, "shard 1")
    assert json.loads((tmp_path / "rest" / "meta.json").read_text())["sequences"] == 2
    for bad, message in [(["--first-shard", "3"], "only 3 shards of 2 answers"),
                         (["--first-shard", "1", "--max-shards", "0"], "--max-shards must be > 0")]:
        with pytest.raises(SystemExit) as exc:
            datagen.main(["--out", str(tmp_path / "bad"), *bad, *common])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "bad" / "meta.json").exists()


def test_datagen_answers_do_not_depend_on_the_verify_step(tmp_path):
    """Bucketed decode steps (padded static shapes, as CUDA graphs replay them) write the same answers as ragged ones,
    greedy and seeded sampled, with the same target features up to rounding."""
    from safetensors.torch import load_file

    from app.drafters.train import datagen

    tiny_target(tmp_path / "target")
    prompt_files(tmp_path / "datasets")
    common = ["--model", str(tmp_path / "target"), "--datasets-dir", str(tmp_path / "datasets"),
              "--per-set", "gsm8k-train=3", "--max-tokens", "8", "--shard-size", "6", "--max-batch", "3"]
    for sampled in ([], ["--samples", "2", "--temperature", "1.0"]):
        shards = {}
        for step in ("ragged", "bucketed"):
            out = tmp_path / f"{step}{len(sampled)}"
            datagen.main(["--out", str(out), "--verify-step", step, *sampled, *common])
            shards[step] = load_file(str(out / "shard-0000.safetensors"))
            assert json.loads((out / "meta.json").read_text())["verify_step"] == step
        ragged, bucketed = shards["ragged"], shards["bucketed"]
        for key in ("tokens", "offsets", "prompt_lens"):
            assert torch.equal(ragged[key], bucketed[key]), (sampled, key)
        torch.testing.assert_close(bucketed["features"].float(), ragged["features"].float(), atol=0.05, rtol=0.05)


def test_datagen_resume_keeps_the_shards_written_and_writes_the_rest(tmp_path, capsys):
    """A run stopped after its first shard, resumed in its folder: the same three shards as a run never stopped,
    the first one not generated again; a resume with other flags, or a new run in that folder, is refused."""
    from safetensors.torch import load_file

    from app.drafters.train import datagen

    tiny_target(tmp_path / "target")
    prompt_files(tmp_path / "datasets")
    common = ["--model", str(tmp_path / "target"), "--datasets-dir", str(tmp_path / "datasets"),
              "--per-set", "gsm8k-train=6", "--max-tokens", "6", "--shard-size", "2", "--max-batch", "2"]
    datagen.main(["--out", str(tmp_path / "full"), *common])
    datagen.main(["--out", str(tmp_path / "part"), "--max-shards", "1", *common])
    first = (tmp_path / "part" / "shard-0000.safetensors").stat().st_mtime_ns
    with pytest.raises(SystemExit) as exc:
        datagen.main(["--out", str(tmp_path / "part"), "--resume", "--seed", "1", *common])
    assert exc.value.code == 2 and "no run with these flags (saved, given): {'seed': (0, 1)}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # a new run there: training would read the old shards beside the new
        datagen.main(["--out", str(tmp_path / "part"), "--max-tokens", "4", *common[:-6], *common[-4:]])
    assert exc.value.code == 2 and "holds 1 shards of an earlier run: --resume continues" in capsys.readouterr().err
    meta_path = tmp_path / "part" / "meta.json"  # the first run took 1000 s: the resumed run's time adds to it
    meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), "seconds": 1000.0}))
    datagen.main(["--out", str(tmp_path / "part"), "--resume", *common])
    assert (tmp_path / "part" / "shard-0000.safetensors").stat().st_mtime_ns == first
    for i in range(3):
        full, part = (load_file(str(tmp_path / d / f"shard-{i:04d}.safetensors")) for d in ("full", "part"))
        assert_same_shard(full, part, f"shard {i}")
    meta, ref = (json.loads((tmp_path / d / "meta.json").read_text()) for d in ("part", "full"))
    assert meta["sequences"] == ref["sequences"] == 6 and meta["new_tokens"] == ref["new_tokens"]
    assert meta["seconds"] > 1000.0


def test_datagen_stopped_while_writing_leaves_no_shard(tmp_path, monkeypatch):
    """A shard is written whole or not at all: a run stopped inside the write leaves no ``shard-*`` file that a
    resume would take as done."""
    from app.drafters.train import datagen

    tiny_target(tmp_path / "target")
    prompt_files(tmp_path / "datasets")
    run = ["--out", str(tmp_path / "data"), "--model", str(tmp_path / "target"), "--datasets-dir",
           str(tmp_path / "datasets"), "--per-set", "gsm8k-train=2", "--max-tokens", "4", "--shard-size", "2"]
    write = datagen.save_file

    def stopped_halfway(tensors, filename, **kwargs):
        write(tensors, filename, **kwargs)
        Path(filename).write_bytes(Path(filename).read_bytes()[:100])
        raise KeyboardInterrupt

    monkeypatch.setattr(datagen, "save_file", stopped_halfway)
    with pytest.raises(KeyboardInterrupt):
        datagen.main(run)
    assert not list((tmp_path / "data").glob("shard-*.safetensors"))
    monkeypatch.setattr(datagen, "save_file", write)
    datagen.main([*run, "--resume"])
    assert [p.name for p in (tmp_path / "data").glob("shard-*.safetensors")] == ["shard-0000.safetensors"]


def test_trainer_resume_continues_only_the_same_run(tmp_path, capsys, monkeypatch):
    """``--resume`` needs the run's state and its flags (paths compared as folders, not as text); a finished run
    resumed leaves its checkpoint as it is: what calibration and the draft vocabulary wrote into it since stays."""
    from app.drafters.train import datagen, trainer

    tiny_target(tmp_path / "target")
    prompt_files(tmp_path / "datasets")
    datagen.main(["--out", str(tmp_path / "data"), "--model", str(tmp_path / "target"), "--datasets-dir",
                  str(tmp_path / "datasets"), "--per-set", "gsm8k-train=24", "--max-tokens", "8", "--max-batch", "8"])
    out = tmp_path / "ckpt"
    run = ["--data", str(tmp_path / "data"), "--out", str(out), "--model", str(tmp_path / "target"), "--steps", "4",
           "--batch-seqs", "2", "--anchors", "4", "--save-every", "2", "--eval-every", "2", "--heldout", "0.25",
           "--config", json.dumps({"num_layers": 1, "intermediate_size": 64, "rank": 8, "block_size": 4})]
    with pytest.raises(SystemExit) as exc:
        trainer.main([*run, "--resume"])
    assert exc.value.code == 2 and "no training state" in capsys.readouterr().err
    trainer.main(run)
    first = (out / "model.safetensors").read_bytes()
    evals = json.loads((out / "config.json").read_text())["metadata"]["train"]["heldout_evals"]
    assert [e["step"] for e in evals] == [2, 4] and all(1.0 <= e["tau"] <= 5.0 for e in evals)
    with pytest.raises(SystemExit) as exc:
        trainer.main([*run, "--lr", "0.01", "--resume"])
    assert exc.value.code == 2 and "'lr': (0.001, 0.01)" in capsys.readouterr().err
    doc = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**doc, "calibration": {"written": "after training"}}))
    calibrated = (out / "config.json").read_bytes()
    monkeypatch.chdir(tmp_path)  # the same folders, given relative to another working directory
    relative = [str(Path(a).relative_to(tmp_path)) if a.startswith(str(tmp_path)) else a for a in run]
    capsys.readouterr()
    trainer.main([*relative, "--resume"])
    assert "finished (4 steps); its checkpoint is left as it is" in capsys.readouterr().out
    assert (out / "model.safetensors").read_bytes() == first and (out / "config.json").read_bytes() == calibrated


def test_self_written_prompts_feed_datagen(tmp_path, capsys):
    """The tiny target writes prompts (what it writes is noise; the cleaning and the file format are what count),
    and datagen answers a sample of that file like any training set."""
    from app.drafters.train import datagen, self_prompts

    tiny_target(tmp_path / "target")
    prompt_files(tmp_path / "datasets")
    out = tmp_path / "self.jsonl"
    self_prompts.main(["--out", str(out), "--limit", "12", "--max-tokens", "10", "--min-chars", "1",
                       "--max-batch", "12", "--model", str(tmp_path / "target"),
                       "--datasets-dir", str(tmp_path / "datasets")])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["asked"] == 12 and report["kept"] + sum(report["dropped"].values()) == 12
    prompts = [json.loads(line)["turns"][0] for line in out.read_text().splitlines()]
    assert len(prompts) == report["kept"] >= 2 and len(set(prompts)) == len(prompts)
    datagen.main(["--out", str(tmp_path / "data"), "--per-set", f"{out}=2", "--max-tokens", "4", "--max-batch", "2",
                  "--model", str(tmp_path / "target"), "--datasets-dir", str(tmp_path / "datasets")])
    assert json.loads((tmp_path / "data" / "meta.json").read_text())["sequences"] == 2
    with pytest.raises(SystemExit) as exc:
        datagen.main(["--out", str(tmp_path / "bad"), "--per-set", f"{tmp_path / 'none.jsonl'}=2",
                      "--model", str(tmp_path / "target"), "--datasets-dir", str(tmp_path / "datasets")])
    assert exc.value.code == 2 and "none.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize("text, expected", [
    (' Question: "How do volcanoes form?"\n2. Why...', "How do volcanoes form?"),
    (" **Write a poem about trains,  in four lines.**", "Write a poem about trains, in four lines."),
    (" 3. User input: Summarise this text: the sea is blue.", "Summarise this text: the sea is blue."),
    (" See https://example.com for the rules of chess", None),
    (" Hi", None),
])
def test_clean_prompt_keeps_the_first_paragraph_without_labels(text, expected):
    from app.drafters.train.self_prompts import clean_prompt

    assert clean_prompt(text, min_chars=5) == expected


@pytest.mark.parametrize("tool, argv, message", [
    ("trainer", ["--steps", "0"], "argument --steps: expected an integer >= 1, got 0"),
    ("trainer", ["--batch-seqs", "0"], "argument --batch-seqs: expected an integer >= 1, got 0"),
    ("trainer", ["--anchors", "0"], "argument --anchors: expected an integer >= 1, got 0"),
    ("trainer", ["--max-minutes", "-1"], "argument --max-minutes: expected a number > 0, got -1"),
    ("trainer", ["--lr", "-1"], "argument --lr: expected a number > 0, got -1"),
    ("trainer", ["--heldout", "0"], "argument --heldout: expected a fraction in (0, 0.5], got 0"),
    ("trainer", ["--heldout", "1"], "argument --heldout: expected a fraction in (0, 0.5], got 1"),
    ("trainer", ["--target-topk", "0"], "argument --target-topk: expected an integer >= 1, got 0"),
    ("calibrate", ["--anchors", "0"], "argument --anchors: expected an integer >= 1, got 0"),
    ("calibrate_lookup", ["--max-ngram", "0"], "argument --max-ngram: expected an integer >= 1, got 0"),
    ("calibrate_lookup", ["--positions", "0"], "argument --positions: expected an integer >= 1, got 0"),
    ("datagen", ["--max-tokens", "0"], "argument --max-tokens: expected an integer >= 1, got 0"),
    ("datagen", ["--temperature", "-1"], "argument --temperature: expected a number >= 0, got -1"),
    ("datagen", ["--max-batch", "0"], "argument --max-batch: expected an integer >= 1, got 0"),
    ("evaluate", ["--temperatures", "0", "-1"], "argument --temperatures: expected a number >= 0, got -1"),
])
def test_bad_flag_values_are_usage_errors_naming_them(tmp_path, capsys, tool, argv, message):
    """Each was a traceback from deep inside the run (ZeroDivisionError, IndexError, a reshape error) or, for
    --heldout 1 and --positions 0, a run that went on with a meaningless value."""
    import importlib

    module = importlib.import_module(f"app.eval.{tool}" if tool == "evaluate" else f"app.drafters.train.{tool}")
    required = {"trainer": ["--data", str(tmp_path), "--out", str(tmp_path / "out")],
                "calibrate": ["--checkpoint", str(tmp_path), "--data", str(tmp_path)],
                "calibrate_lookup": ["--checkpoint", str(tmp_path), "--greedy-data", str(tmp_path)],
                "datagen": ["--out", str(tmp_path / "data")], "evaluate": []}[tool]
    with pytest.raises(SystemExit) as exc:
        module.main([*required, *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_data_the_tools_would_misread_is_refused(tmp_path, capsys):
    """Training data that is not there or given twice, a top-k wider than the vocabulary, calibration on data the
    checkpoint was not trained on, and greedy answers given as sampled ones to the lookup table; a --gamma longer
    than the checkpoint's block is evaluated at the block, and says so."""
    from app.drafters.train import calibrate, calibrate_lookup, datagen, trainer
    from app.eval import evaluate

    tiny_target(tmp_path / "target")
    prompt_files(tmp_path / "datasets")
    for name, seed in (("data", "0"), ("other", "1")):
        datagen.main(["--out", str(tmp_path / name), "--model", str(tmp_path / "target"), "--datasets-dir",
                      str(tmp_path / "datasets"), "--per-set", "gsm8k-train=8", "--max-tokens", "6", "--seed", seed])
    data, out = str(tmp_path / "data"), tmp_path / "ckpt"
    small = ["--config", json.dumps({"num_layers": 1, "intermediate_size": 64, "rank": 8, "block_size": 4})]

    def refused(main, argv: list[str], message: str) -> None:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err

    refused(trainer.main, ["--data", str(tmp_path / "nope"), "--out", str(out)], "--data: no shard-*.safetensors in")
    refused(trainer.main, ["--data", data, data, "--out", str(out)], "--data: data folder")
    refused(trainer.main, ["--data", data, "--out", str(out), "--target-topk", "100000", *small],
            "--target-topk 100000 exceeds the target's vocabulary of")
    trainer.main(["--data", data, "--out", str(out), "--steps", "2", "--batch-seqs", "2", "--anchors", "2",
                  "--heldout", "0.25", *small])
    refused(calibrate.main, ["--checkpoint", str(out), "--data", str(tmp_path / "other")],
            f"--data {tmp_path / 'other'} is not what {out} was trained on ({data})")
    refused(calibrate_lookup.main, ["--checkpoint", str(out), "--greedy-data", data, "--sampled-data", data],
            f"--sampled-data {data} holds greedy answers (its meta.json: temperature 0.0)")
    evaluate.main(["--checkpoint", str(out), "--gamma", "12", "--sets", "humaneval", "--temperatures", "0",
                   "--limit", "1", "--max-tokens", "4", "--datasets-dir", str(tmp_path / "datasets"), "--out",
                   str(tmp_path / "eval")])
    assert f"--gamma 12: {out} drafts at most 4 tokens a round; evaluated at 4" in capsys.readouterr().err
