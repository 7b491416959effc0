"""AppConfig validation, the YAML defaults, the n-gram drafter, the Router's pure parts and the built deployments'
log settings (no Ray cluster)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from app.drafters.ngram import lookup
from app.scheduling.profile import ProfileMismatchError, load_profile
from app.serving.config import REPO_ROOT, AppConfig
from app.serving.router import verification_capacity
from tests.conftest import TINY_LLAMA, write_model_dir


@pytest.mark.parametrize("args,field", [
    ({"polcy": "dspark"}, "polcy"),
    ({"policy": "fastest"}, "policy"),
    ({"gamma": 0}, "gamma"),
    ({"target": {"num_cpus": -1}}, "target.num_cpus"),
    ({"target": {"gpus": 1}}, "target.gpus"),
    ({"drafter": "eagle"}, "drafter"),
    ({"drafter_placement": "remote"}, "drafter_placement"),
    ({"step_timeout_s": 0.001}, "step_timeout_s"),  # every step would trip it: the replica replaced again and again
    ({"drafter_state_ttl_s": 0}, "drafter_state_ttl_s"),
])
def test_bad_config_names_the_field(args, field):
    with pytest.raises(ValidationError) as info:
        AppConfig.model_validate(args)
    assert field in str(info.value)


def test_chunked_prefill_is_on_unless_batch_invariant_where_asking_for_it_is_an_error():
    assert AppConfig().chunked_prefill and not AppConfig(enable_chunked_prefill=False).chunked_prefill
    assert not AppConfig(engine={"batch_invariant": True}).chunked_prefill
    with pytest.raises(ValidationError, match="enable_chunked_prefill"):
        AppConfig(enable_chunked_prefill=True, engine={"batch_invariant": True})


def test_missing_files_name_the_field(tmp_path):
    with pytest.raises(FileNotFoundError, match="drafter_checkpoint"):
        AppConfig(drafter_checkpoint=str(tmp_path / "nothing")).check_files()
    with pytest.raises(FileNotFoundError, match="profile"):
        AppConfig(profile=str(tmp_path / "none.json"), drafter="ngram").check_files()
    AppConfig(policy="none", drafter_checkpoint=str(tmp_path / "nothing")).check_files()  # no drafter needed


def test_a_chat_template_is_a_file_s_path_or_the_template_s_text(tmp_path):
    """vLLM's ``--chat-template``: a path (relative: to the repository root, as every path here) is read into the
    engine's ``chat_template`` at the top level or in the engine section; the text itself is taken as is; a missing
    file, text without Jinja markup given to the engine directly, and a template that does not compile (found at
    start, not in every chat request) name the field. Auto tool choice needs a parser."""
    from app.engine.config import EngineConfig

    shipped = AppConfig(chat_template="deployments/templates/chatml_tools.jinja", drafter="ngram")
    assert shipped.engine.chat_template == (REPO_ROOT / "deployments/templates/chatml_tools.jinja").read_text()
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    assert AppConfig(engine={"chat_template": str(tmp_path / "t.jinja")}).engine.chat_template == \
        "{{ messages[0]['content'] }}"
    assert AppConfig(chat_template="{% for m in messages %}{{ m.content }}{% endfor %}").engine.chat_template \
        .startswith("{% for m")
    with pytest.raises(ValidationError, match="chat_template 'nowhere.jinja' is neither"):
        AppConfig(chat_template="nowhere.jinja")
    with pytest.raises(ValidationError, match="has no Jinja markup"):
        EngineConfig(chat_template="t.jinja")
    with pytest.raises(ValidationError, match="chat_template does not compile: line 1: unexpected '%'"):
        AppConfig(chat_template="{%- for m in messages -%{{ m.content }}{% endfor %}")
    with pytest.raises(ValidationError, match="set tool_call_parser"):
        AppConfig(enable_auto_tool_choice=True)
    assert AppConfig(enable_auto_tool_choice=True, tool_call_parser="llama3_json").tool_call_parser == "llama3_json"


def test_a_model_that_cannot_load_fails_before_any_replica_starts(tmp_path, tiny_llama_dir):
    """``checked_config`` (run by the launcher before Ray starts, and by the builder) checks the target's files and
    architecture as the engine would, naming ``engine.model``, whatever the drafter (here one that needs no files)."""
    def check(model: str, **engine) -> None:
        AppConfig(engine={"model": model, **engine}, drafter="ngram", profile="auto").check_files()

    with pytest.raises(FileNotFoundError, match=r"engine\.model: model '.*no-such-model' is neither"):
        check(str(tmp_path / "no-such-model"))
    with pytest.raises(FileNotFoundError, match=r"engine\.model: no \*\.safetensors weights in .*tiny-llama"):
        check(str(tiny_llama_dir))
    check(str(tiny_llama_dir), load_format="dummy")
    with pytest.raises(ValueError, match=r"engine\.max_model_len: 4096 exceeds the context limit of .*, 2048 tokens"):
        check(str(tiny_llama_dir), load_format="dummy", max_model_len=4096)
    gpt2 = write_model_dir(tmp_path / "gpt2", {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(ValueError, match="engine.model: unsupported target architecture"):
        check(str(gpt2), load_format="dummy")
    bare = write_model_dir(tmp_path / "bare", TINY_LLAMA, tokenizer=False)
    with pytest.raises(FileNotFoundError, match="engine.model: no tokenizer in"):
        check(str(bare), load_format="dummy")


def test_prompt_lookup_needs_the_checkpoints_table(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"kind": "dspark", "config": {"target": "smollm2-135m"}}))
    with pytest.raises(ValueError, match="prompt_lookup"):
        AppConfig(drafter_checkpoint=str(tmp_path)).check_files()
    AppConfig(drafter_checkpoint=str(tmp_path), prompt_lookup=False).check_files()
    AppConfig().check_files()  # the committed checkpoint carries its table


def test_relative_paths_resolve_against_the_repo():
    name = "profiles/dspark-engine-smollm2-135m-intel-r-xeon-r-processor-avx512-2-threads.json"
    config = AppConfig(profile=name)
    assert config.profile == config.profile_path() == str(REPO_ROOT / name)
    assert Path(config.drafter_checkpoint).is_absolute()


def write_measured(directory: Path, name: str, *, hardware: str, date: str, model: str = "smollm2-135m") -> Path:
    """A copy of a committed profile with another provenance (hardware, date, model)."""
    data = json.loads((REPO_ROOT / "profiles/dspark-engine-smollm2-135m-amd-epyc-avx512-2-threads.json").read_text())
    data["provenance"].update(hardware=hardware, date=date, model=model)
    path = directory / name
    path.write_text(json.dumps(data))
    return path


def test_auto_profile_picks_this_hosts_measured_profile(tmp_path, monkeypatch, caplog):
    from app.engine import hardware
    from app.serving import config as config_module
    from app.serving.profiles import profile_cache_path

    monkeypatch.setattr(config_module, "PROFILES_DIR", tmp_path)
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(hardware, "hardware_name", lambda device, threads=None: f"CPU X {threads} threads")
    write_measured(tmp_path, "a.json", hardware="CPU X 2 threads", date="2026-11-01")
    new = write_measured(tmp_path, "b.json", hardware="CPU X 2 threads", date="2026-11-20")
    write_measured(tmp_path, "c.json", hardware="CPU X 4 threads", date="2026-11-25")
    write_measured(tmp_path, "d.json", hardware="CPU X 2 threads", date="2026-11-28", model="other-model")
    assert AppConfig(device="cpu", dtype="bfloat16", torch_threads=2).profile_path() == str(new)  # newer of a, b
    # a float32 target on the same host: the bfloat16 profiles do not fit it (its steps cost another amount)
    assert AppConfig(device="cpu", dtype="float32", torch_threads=2).committed_profile_path() is None
    # nor do ragged steps' profiles fit an engine that pads its steps to buckets
    bucketed = AppConfig.model_validate({"engine": {"device": "cpu", "dtype": "bfloat16", "verify_step": "bucketed"},
                                         "torch_threads": 2})
    assert bucketed.committed_profile_path() is None
    default_key = profile_cache_path(AppConfig(device="cpu", dtype="bfloat16", torch_threads=2),
                                     hardware="CPU X 2 threads", dtype="bfloat16")
    assert profile_cache_path(bucketed, hardware="CPU X 2 threads", dtype="bfloat16") != default_key
    # nor does an engine set to another attention backend or elementwise mode share a cached start-up profile
    for engine in ({"attention": "sdpa"}, {"compile_elementwise": False}, {"compile_elementwise": True}):
        other = AppConfig.model_validate({"engine": {"device": "cpu", "dtype": "bfloat16", **engine},
                                          "torch_threads": 2})
        assert profile_cache_path(other, hardware="CPU X 2 threads", dtype="bfloat16") != default_key, engine
    # another host: nothing committed, so the target replica measures one at start-up and caches it
    other_host = AppConfig(device="cpu", dtype="bfloat16", torch_threads=8)
    assert other_host.profile_path() is None
    cached = profile_cache_path(other_host, hardware="CPU X 8 threads", dtype="bfloat16")
    assert cached.parent == tmp_path / "cache" / "profiles"
    cached.parent.mkdir(parents=True)
    cached.write_text((tmp_path / "c.json").read_text())
    assert other_host.profile_path() == str(cached)
    assert profile_cache_path(AppConfig(device="cpu", dtype="float32"), hardware="CPU X 8 threads",
                              dtype="float32") != cached
    # the mock engine cannot be measured: the newest measured profile of the model, with a warning naming its host
    assert AppConfig(device="cpu", torch_threads=8, mock_engine=True, drafter="mock").profile_path() == str(
        tmp_path / "c.json")
    assert "CPU X 4 threads" in caplog.text
    with pytest.raises(FileNotFoundError, match="no measured profile of third-model"):
        AppConfig(device="cpu", model="third-model", mock_engine=True, drafter="mock").profile_path()


def test_named_profile_of_another_model_fails_naming_both(tmp_path):
    other = write_measured(tmp_path, "other.json", hardware="CPU X 2 threads", date="2026-11-01", model="Qwen3-8B")
    with pytest.raises(ProfileMismatchError, match=r"profile .*other.json does not fit the target smollm2-135m"):
        AppConfig(profile=str(other), drafter="ngram").check_files()
    with pytest.raises(ProfileMismatchError, match="dtype 'bfloat16' does not match the running dtype 'float32'"):
        AppConfig(profile=str(write_measured(tmp_path, "own.json", hardware="h", date="2026-11-01")),
                  drafter="ngram", dtype="float32").check_files()
    AppConfig(profile=str(tmp_path / "own.json"), drafter="ngram", dtype="bfloat16").check_files()


def test_named_profile_of_another_verify_step_is_warned_about(tmp_path, caplog):
    own = str(write_measured(tmp_path, "own.json", hardware="h", date="2026-11-01"))  # measured ragged
    AppConfig(profile=own, drafter="ngram", dtype="bfloat16").check_files()
    assert "verify_step" not in caplog.text
    AppConfig.model_validate({"engine": {"dtype": "bfloat16", "verify_step": "bucketed"}, "profile": own,
                              "drafter": "ngram"}).check_files()
    assert "measured with verify_step ragged, the engine runs bucketed" in caplog.text


def test_engine_section_holds_every_engine_setting():
    config = AppConfig.model_validate({"engine": {"model": "/m", "load_format": "dummy", "feature_layers": [0, 1],
                                                  "prepack": False, "max_num_seqs": 4}, "gamma": 5})
    engine = config.engine_config()
    assert (engine.model, engine.load_format, engine.feature_layers, engine.prepack) == ("/m", "dummy", (0, 1), False)
    assert (engine.max_num_seqs, engine.max_draft_len, config.max_num_seqs, config.model) == (4, 5, 4, "/m")
    # the top-level shorthands land in the same section
    assert AppConfig(model="/m", max_num_seqs=4).engine == AppConfig(engine={"model": "/m", "max_num_seqs": 4}).engine
    with pytest.raises(ValidationError, match="model is set both at the top level and in the engine section"):
        AppConfig.model_validate({"model": "/a", "engine": {"model": "/b"}})
    with pytest.raises(ValidationError, match="set gamma instead"):
        AppConfig.model_validate({"engine": {"max_draft_len": 3}})
    with pytest.raises(ValidationError, match="engine.prepak"):
        AppConfig.model_validate({"engine": {"prepak": True}})


def test_the_served_model_name_is_the_model_unless_set():
    assert AppConfig().served_model_name == "smollm2-135m"
    assert AppConfig(engine={"model": "/models/Qwen3-8B"}, drafter="ngram").served_model_name == "/models/Qwen3-8B"
    assert AppConfig(model="/models/Qwen3-8B", drafter="ngram").served_model_name == "/models/Qwen3-8B"
    assert AppConfig(model="/models/Qwen3-8B", drafter="ngram", served_model_name="qwen3").served_model_name == "qwen3"


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("DSPARK_API_KEY", "k1")
    assert AppConfig().resolved_api_key == "k1"
    assert AppConfig(api_key="k2").resolved_api_key == "k2"
    assert AppConfig(api_key="").resolved_api_key is None


@pytest.mark.parametrize("name", ["dspark.yaml", "dspark-colocated.yaml", "dspark-cluster.yaml"])
def test_yaml_args_validate(name):
    doc = yaml.safe_load((REPO_ROOT / "deployments" / name).read_text())
    (app,) = doc["applications"]
    assert app["import_path"] == "app.serving.builder:build_app"
    config = AppConfig.model_validate(app["args"])
    if name != "dspark-cluster.yaml":
        assert doc["http_options"]["host"] == "127.0.0.1"
        separate = config.drafter_placement == "separate"
        assert separate == (name == "dspark.yaml")
        drafter = config.drafter_replicas.num_cpus if separate else 0.0
        total = config.target.num_cpus + drafter + config.ingress.num_cpus
        assert total + config.router_num_cpus <= 2 and config.target.num_gpus == 0
    else:
        assert config.target.resources and config.drafter_replicas.resources
        assert set(config.target.resources) != set(config.drafter_replicas.resources)


def test_the_cluster_config_builds_on_a_node_without_a_gpu(monkeypatch):
    # The application is built (and the Router runs) wherever Ray puts them, e.g. a CPU-only head node: 'auto'
    # is left to the target replicas on their GPUs instead of asking CUDA here.
    import torch

    from app.serving.builder import checked_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (app,) = yaml.safe_load((REPO_ROOT / "deployments" / "dspark-cluster.yaml").read_text())["applications"]
    config = checked_config(app["args"])
    assert config.engine.device == "cuda" and config.profile == "auto"
    assert config.committed_profile_path() is None and config.profile_path() is None


def test_ngram_lookup():
    assert lookup([1, 2, 3, 9, 1, 2, 3], max_ngram=3, gamma=4) == ([9, 1, 2, 3], 3)
    assert lookup([5, 6, 7], max_ngram=3, gamma=4) == ([], 0)
    assert lookup([4, 8, 4], max_ngram=2, gamma=2) == ([8, 4], 1)


def test_verification_capacity_shrinks_with_load_and_grows_with_acceptance():
    xeon = "dspark-engine-smollm2-135m-intel-r-xeon-r-processor-avx512-2-threads.json"
    profile = load_profile(REPO_ROOT / "profiles" / xeon)
    assert verification_capacity(profile, batch=0, acceptance=0.9, gamma=7) == 0
    per_request = [verification_capacity(profile, batch=b, acceptance=0.8, gamma=7) / b for b in (1, 16, 128)]
    assert per_request == sorted(per_request, reverse=True) and per_request[0] > 0
    assert verification_capacity(profile, batch=8, acceptance=0.2, gamma=7) <= verification_capacity(
        profile, batch=8, acceptance=0.9, gamma=7)


def deployments(app):
    """The deployments an application binds (its own, then those bound into its arguments)."""
    from ray.serve.deployment import Application

    bound = app._bound_deployment
    yield bound
    for arg in [*bound.init_args, *bound.init_kwargs.values()]:
        if isinstance(arg, Application):
            yield from deployments(arg)


MOCK_APP = {"mock_engine": True, "drafter": "mock", "profile": "tests/fixtures/profiles/test-mock-model-any.json"}


def test_per_round_deployments_log_no_access_line_per_call():
    """The Drafter (one call per target round) and the Router (load reports) have Serve's access log off; the
    ingress and the target keep theirs (one line per request)."""
    from app.serving.builder import build_app

    access_log = {d.name: (d.logging_config or {}).get("enable_access_log", True)
                  for d in deployments(build_app(MOCK_APP))}
    assert access_log == {"Ingress": True, "Target": True, "Drafter": False, "Router": False}


@pytest.mark.parametrize("ingress_replicas", [1, 3])
def test_the_router_takes_every_admitted_request_s_target_choice_at_once(ingress_replicas):
    """Each request an ingress admits asks the Router for its target: a burst of them must not exceed the Router's
    max_ongoing_requests (Serve rejects the excess, and the ingress retries with back-off)."""
    from app.serving.builder import build_app
    from app.serving.ingress import admission_limit

    args = {**MOCK_APP, "ingress": {"num_replicas": ingress_replicas}}
    config = AppConfig.model_validate(args)
    limits = {d.name: d._deployment_config.max_ongoing_requests for d in deployments(build_app(args))}
    assert limits["Router"] > ingress_replicas * admission_limit(config) >= 16
