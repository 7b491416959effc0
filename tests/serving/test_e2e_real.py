"""End to end through HTTP with the real default target: greedy output of the served speculative path equals
plain greedy decoding for 11 concurrent prompts, one prefilled in pieces (near-ties allowed), and 16 concurrent
sampled requests speculate without a single fallback to plain decoding, with the drafter in its own replica (over
Serve's gRPC data plane, ``SERVE_ENV``) and colocated in the target replica; streaming equals non-streaming, each
sampling control equals plain decoding and a log-likelihood request (token ids, ``echo``, ``logprobs``) is scored as
the engine scores it, on the default placement.

Uses the DSpark checkpoint when it is present, else the n-gram drafter (the serving path is the same).
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from ray import serve

from app.loop import generate
from app.engine.types import SamplingParams
from app.serving.builder import build_app
from app.serving.config import AppConfig
from tests.conftest import load_prompts
from tests.engine.near_tie import check_greedy_output, check_same_or_near_tie
from tests.serving.helpers import delete_in_background, shared_serve, sse_events, stream_text

pytestmark = pytest.mark.serial  # conftest.py: runs alone, after the parallel phase

MAX_TOKENS = 32
CHECKPOINT = Path(AppConfig().drafter_checkpoint)
DRAFTER = "dspark" if (CHECKPOINT / "config.json").is_file() else "ngram"


_PLAIN: dict[str, list] = {}  # plain decodes in this process, the same reference for both placements


def plain_decode(engine, key: str, prompt_ids: list[list[int]], params: SamplingParams) -> list:
    """``generate(engine, prompt_ids, params)``'s results without speculation, decoded once per ``key``."""
    if key not in _PLAIN:
        _PLAIN[key], _ = generate(engine, prompt_ids, params)
    return _PLAIN[key]


@pytest.fixture(scope="module", params=["separate", "colocated"])
def url(request):
    base = shared_serve()
    serve.run(build_app({
        "drafter": DRAFTER, "drafter_placement": request.param, "policy": "dspark",
        "gamma": 7 if DRAFTER == "dspark" else 5, "device": "cpu",
        "max_model_len": 1024, "max_num_seqs": 16, "torch_threads": 2,
        # the drafter runs in every round: at 16 requests on 2 cores the gate or the speculation guard would skip
        # it, and the sampled test must see the drafter's answers for a full batch cross the transport
        "draft_gate": False, "speculation_guard": False,
        "target": {"num_cpus": 0.5}, "drafter_replicas": {"num_cpus": 0.5}, "ingress": {"num_cpus": 0.1},
        # renders as SmolLM2's own template where no tools are given (test_tools.py), so the other tests see the same
        "chat_template": "deployments/templates/chatml_tools.jinja", "tool_call_parser": "hermes",
        "enable_auto_tool_choice": True,
    }), name=f"real-{request.param}", route_prefix=f"/{request.param}")
    yield f"{base}/{request.param}"
    delete_in_background(f"real-{request.param}")


# Streaming and the sampling controls act in the ingress and the target's verification, the same code whichever
# placement the drafter has: checked on the default one only.
DEFAULT_PLACEMENT_ONLY = pytest.mark.parametrize("url", ["separate"], indirect=True)


def target_state(url: str) -> dict:
    """The Target replica's ``debug_state`` of the application that ``url`` (the ``url`` fixture) serves."""
    return serve.get_deployment_handle("Target", f"real-{url.rsplit('/', 1)[-1]}").debug_state.remote().result()


def chat_body(prompt: str, **extra) -> dict:
    return {"model": "smollm2-135m", "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": MAX_TOKENS, **extra}


@pytest.mark.slow
def test_served_greedy_equals_plain_greedy_under_batching(url, engine, eval_prompts):
    """Ten prompts at once, and one of ~630 tokens (over the 512-token prefill budget: prefilled in pieces while the
    others decode, ``enable_chunked_prefill``), against plain decoding of each prompt prefilled whole."""
    prompts = eval_prompts[:10] + ["\n\n".join(eval_prompts)[:2600]]

    async def send_all() -> list[dict]:
        async with httpx.AsyncClient(timeout=300) as client:
            responses = await asyncio.gather(*[
                client.post(f"{url}/v1/chat/completions", json=chat_body(p, return_token_ids=True, spec_stats=True))
                for p in prompts
            ])
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
        return [r.json() for r in responses]

    served = asyncio.run(send_all())
    prompt_ids = [engine.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    plain = plain_decode(engine, "batching", prompt_ids, SamplingParams(max_tokens=MAX_TOKENS))
    ties = []
    for ids, ref, body in zip(prompt_ids, plain, served):
        assert body["usage"]["prompt_tokens"] == len(ids)
        assert body["usage"]["completion_tokens"] == len(body["token_ids"])
        note = check_greedy_output(engine, ids, ref.token_ids, body["token_ids"])
        if note is None:
            assert body["choices"][0]["message"]["content"] == ref.text
        else:
            ties.append(note)
    # Each divergence above starts at a near-tie (bf16 logits depend on the step's shape; how many prompts meet one
    # depends on the drafter and the batch mix, up to 8 of 10 seen), and past it the served output is checked token by
    # token as a greedy path of its own: a path that leaves the target's choices fails however many ties it met.
    print(f"drafter {DRAFTER}: {len(ties)} near-ties of {len(prompts)}: {ties}")
    assert sum(b["spec_stats"]["accepted_tokens"] for b in served) > 0, "the drafter never contributed"
    assert not any(b["spec_stats"]["fallback"] for b in served), "drafter calls failed"


@pytest.mark.slow
def test_sixteen_concurrent_sampled_requests_never_fall_back(url, eval_prompts):
    """Sampled drafts used to carry dense [K, V] float32 draft probabilities: from 4 concurrent sampled requests the
    drafter's answer passed the gRPC data plane's 4 MiB limit and every request fell back to plain decoding. The
    server's own counters must show no fallback and no drafter failure."""
    prompts = (eval_prompts * 2)[:16]

    async def send_all() -> list[dict]:
        async with httpx.AsyncClient(timeout=300) as client:
            responses = await asyncio.gather(*[
                client.post(f"{url}/v1/chat/completions",
                            json=chat_body(p, temperature=0.7, max_tokens=8, spec_stats=True)) for p in prompts
            ])
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
        return [r.json() for r in responses]

    before = target_state(url)
    served = asyncio.run(send_all())
    state = target_state(url)
    assert state["fallbacks"] == {} and state["drafter_failures"] == 0, state
    assert state["drafted_rounds"] > before["drafted_rounds"], "the drafter was never called"
    assert not any(b["spec_stats"]["fallback"] for b in served)
    assert sum(b["spec_stats"]["draft_tokens"] for b in served) > 0


@pytest.mark.slow
@DEFAULT_PLACEMENT_ONLY
def test_streaming_concatenation_equals_non_streamed(url, eval_prompts):
    for prompt in eval_prompts[10:12]:
        plain = httpx.post(f"{url}/v1/chat/completions", json=chat_body(prompt), timeout=300).json()
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat_body(prompt, stream=True),
                          timeout=300) as r:
            events = sse_events(r)
        assert stream_text(events) == plain["choices"][0]["message"]["content"]
        assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == \
            plain["choices"][0]["finish_reason"]
    # a stop string holds text back: each streamed chunk still carries the tokens of its text (the last may be cut)
    answer = plain["choices"][0]["message"]["content"]
    stop = answer.split()[len(answer.split()) // 2]
    body = {**chat_body(eval_prompts[11], stream=True), "stop": [stop], "logprobs": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        chunks = [c for e in sse_events(r) for c in e["choices"] if c.get("logprobs")]
    texts = [c["delta"].get("content", "") for c in chunks]
    tokens = ["".join(t["token"] for t in c["logprobs"]["content"]) for c in chunks]
    assert "".join(texts) == answer[: answer.index(stop)] and texts[:-1] == tokens[:-1], (texts, tokens)


@pytest.mark.slow
def test_openai_client_text_parts_and_models_on_the_real_engine(url):
    """The official client against the real target: text parts read as their joined text, and models.retrieve carries
    the context limit."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60, max_retries=0)
    parts = [{"type": "text", "text": "What is 2+3?"}, {"type": "text", "text": "Answer briefly."}]
    split = client.chat.completions.create(model="smollm2-135m", temperature=0, max_tokens=8,
                                           messages=[{"role": "user", "content": parts}])
    joined = client.chat.completions.create(model="smollm2-135m", temperature=0, max_tokens=8,
                                            messages=[{"role": "user", "content": "What is 2+3?\nAnswer briefly."}])
    assert split.choices[0].message.content == joined.choices[0].message.content
    assert split.usage.prompt_tokens == joined.usage.prompt_tokens
    assert client.models.retrieve("smollm2-135m").model_extra["max_model_len"] == 1024


@pytest.mark.slow
@DEFAULT_PLACEMENT_ONLY
def test_echo_with_logprobs_scores_a_token_id_prompt_as_the_engine_does(url, engine):
    """A log-likelihood request as evaluation harnesses send it (lm-evaluation-harness's ``local-completions``:
    token ids of context + continuation, ``echo``, ``logprobs`` 1, ``max_tokens`` 1): every prompt token but the first
    scored as the engine alone scores it (same tokens; logprobs within the rounding of another process's step), the
    same when the prompt is sent again and the prefix cache holds it (computed whole: no cached tokens), with
    ``max_tokens`` 0 (the prompt alone), and as vLLM's ``prompt_logprobs`` (ranks as the engine's)."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    ids = engine.encode("Question: What is the capital of France?\nAnswer: The capital of France is Paris.")
    reference = generate(engine, [ids], SamplingParams(max_tokens=1, prompt_logprobs=1))[0][0].prompt_logprobs
    for _ in range(2):
        out = client.completions.create(model="smollm2-135m", prompt=ids, echo=True, logprobs=1, max_tokens=1,
                                        temperature=0)
        lp = out.choices[0].logprobs
        assert out.usage.prompt_tokens == len(ids) and out.usage.prompt_tokens_details.cached_tokens == 0
        assert out.choices[0].text.startswith(engine.tokenizer.decode(ids)) and len(lp.token_logprobs) == len(ids) + 1
        assert lp.token_logprobs[0] is None
        assert lp.token_logprobs[1 : len(ids)] == pytest.approx([e.logprob for e in reference[1:]], abs=0.05)
        assert [max(top, key=top.get) for top in lp.top_logprobs[1 : len(ids)]] == \
            [engine.tokenizer.decode([e.top[0][0]]) for e in reference[1:]]
    alone = client.completions.create(model="smollm2-135m", prompt=ids, echo=True, logprobs=1, max_tokens=0)
    assert alone.choices[0].text == engine.tokenizer.decode(ids)  # the prompt, no sampled token
    assert alone.choices[0].logprobs.tokens == lp.tokens[: len(ids)] and alone.usage.completion_tokens == 0
    assert alone.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1 : len(ids)], abs=0.05)
    vllm = client.completions.create(model="smollm2-135m", prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 2})
    scored = vllm.choices[0].model_extra["prompt_logprobs"]  # vLLM's shape: {token id: logprob, rank, decoded_token}
    assert scored[0] is None and [int(next(iter(d))) for d in scored[1:]] == ids[1:]
    assert [d[str(t)]["logprob"] for d, t in zip(scored[1:], ids[1:])] == \
        pytest.approx([e.logprob for e in reference[1:]], abs=0.05)
    ranks = [(d[str(t)]["rank"], e.rank) for d, t, e in zip(scored[1:], ids[1:], reference[1:])]
    assert sum(a == b for a, b in ranks) >= len(ranks) - 2, ranks  # but at a near-tie, another process's rounding


@DEFAULT_PLACEMENT_ONLY
def test_a_response_over_serve_s_default_grpc_message_limit_is_answered(url, engine):
    """A scored prompt makes a large response (``prompt_logprobs`` 20: ~1.5 kB of JSON a prompt token): 4 choices of a
    1,000-token prompt answer ~6 MB, which Serve's gRPC data plane passes only with the message limit ``SERVE_ENV``
    raises (4 MiB by default: a bare 500 from the proxy after the whole computation)."""
    ids = (engine.encode(" ".join(load_prompts("gsm8k", count=40))) * 2)[:1000]
    r = httpx.post(f"{url}/v1/completions", timeout=300, json={
        "model": "smollm2-135m", "prompt": ids, "max_tokens": 1, "n": 4, "prompt_logprobs": 20})
    assert r.status_code == 200, r.text[:300]
    assert len(r.content) > 5 * 2**20 and [len(c["prompt_logprobs"]) for c in r.json()["choices"]] == [1000] * 4


@DEFAULT_PLACEMENT_ONLY
def test_tokenize_gives_the_ids_the_model_is_prompted_with(url, engine):
    """``POST /tokenize`` with the real tokenizer: a chat through the model's template and a text as the engine encodes
    them, the chat's count the usage of a chat request; ``/detokenize`` gives the text back, special tokens kept."""
    messages = [{"role": "user", "content": "Name a large city in Africa."}]
    chat_ids = httpx.post(f"{url}/tokenize", json={"messages": messages}, timeout=60).json()
    assert chat_ids["tokens"] == engine.encode_chat(messages)
    used = httpx.post(f"{url}/v1/chat/completions", json=chat_body(messages[0]["content"], max_tokens=1),
                      timeout=120).json()["usage"]["prompt_tokens"]
    assert chat_ids["count"] == used
    text = "Paris \U0001F31F ok"
    ids = httpx.post(f"{url}/tokenize", json={"prompt": text, "return_token_strs": True}, timeout=60).json()
    assert ids["tokens"] == engine.encode(text)
    assert ids["token_strs"] == engine.tokenizer.convert_ids_to_tokens(ids["tokens"])
    back = httpx.post(f"{url}/detokenize", json={"tokens": chat_ids["tokens"]}, timeout=60).json()["prompt"]
    assert back == engine.tokenizer.decode(chat_ids["tokens"]) and back.startswith("<|im_start|>")
    # a reply the client started, left open for the model to continue (vLLM's continue_final_message)
    started = messages + [{"role": "assistant", "content": "One large city in Africa is"}]
    opened = httpx.post(f"{url}/tokenize", json={"messages": started, "continue_final_message": True,
                                                 "chat_template_kwargs": {"unused": 1}}, timeout=60).json()
    assert engine.tokenizer.decode(opened["tokens"]).endswith("<|im_start|>assistant\nOne large city in Africa is")
    reserved = httpx.post(f"{url}/tokenize", json={"messages": messages, "chat_template_kwargs": {"tokenize": False}},
                          timeout=60)
    assert (reserved.status_code, reserved.json()["error"]["param"]) == (400, "chat_template_kwargs")


@DEFAULT_PLACEMENT_ONLY
def test_responses_api_streams_to_completion_with_the_official_client(url):
    """``/v1/responses`` on the real model through the SDK's streaming helper: an answer that ends with EOS is
    ``response.completed``, its deltas join into the output text, and usage counts it."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    with client.responses.stream(model="smollm2-135m", input="What is 2+3? Answer with the number only.",
                                 temperature=0, max_output_tokens=48) as stream:  # ends with EOS (test_stops.py)
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text and "".join(deltas) == final.output_text
    assert 0 < final.usage.output_tokens < 48 and final.usage.input_tokens > 10


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


def weather_arguments(call) -> dict:
    """A ``get_weather`` call's arguments, checked against its schema."""
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and call.type == "function" and call.id
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit"), arguments
    return arguments


@DEFAULT_PLACEMENT_ONLY
def test_tool_calls_through_the_official_client(url):
    """Tools on the real model (the tool template, the hermes parser): a named function's call, greedy and sampled,
    follows its schema and finishes with ``stop``, streamed too; ``required`` calls finish with
    ``tool_calls``; the call and its result sent back as the next turn are served (the model then answers or calls
    again, as it chooses); the same through the Responses API (a ``function_call`` item, sent back with its
    output)."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 11}):
        kwargs = dict(model="smollm2-135m", messages=messages, tools=[WEATHER], tool_choice=named, max_tokens=48,
                      **sampling)
        answer = client.chat.completions.create(**kwargs)
        choice = answer.choices[0]
        assert choice.finish_reason == "stop" and choice.message.content is None, choice
        weather_arguments(choice.message.tool_calls[0])
        with client.chat.completions.stream(**kwargs) as stream:
            streamed = stream.get_final_completion().choices[0]
        assert streamed.finish_reason == "stop" and len(streamed.message.tool_calls) == 1
        weather_arguments(streamed.message.tool_calls[0])
    required = client.chat.completions.create(model="smollm2-135m", messages=messages, tools=[WEATHER], max_tokens=64,
                                              tool_choice="required", parallel_tool_calls=False, temperature=0)
    assert required.choices[0].finish_reason == "tool_calls" and len(required.choices[0].message.tool_calls) == 1
    call = required.choices[0].message.tool_calls[0]
    weather_arguments(call)
    history = [*messages, required.choices[0].message.model_dump(),
               {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    after = client.chat.completions.create(model="smollm2-135m", messages=history, tools=[WEATHER], max_tokens=24,
                                           temperature=0)
    assert after.choices[0].message.content or after.choices[0].message.tool_calls
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "wat"}}}}}
    with pytest.raises(openai.BadRequestError) as err:  # the grammar library refuses the schema: named in the error
        client.chat.completions.create(model="smollm2-135m", messages=messages, tools=[WEATHER, bad],
                                       tool_choice={"type": "function", "function": {"name": "f"}}, max_tokens=8)
    assert err.value.body["param"] == "tools.1.function.parameters" and "wat" in err.value.body["message"]
    flat = {"type": "function", "name": "get_weather", **{k: WEATHER["function"][k] for k in ("description",
                                                                                               "parameters")}}
    with client.responses.stream(model="smollm2-135m", input="What is the weather in Paris?", tools=[flat],
                                 tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                 max_output_tokens=48) as stream:
        response = stream.get_final_response()
    [item] = response.output
    assert item.type == "function_call" and set(json.loads(item.arguments)) == {"city", "unit"}
    followed = client.responses.create(model="smollm2-135m", tools=[flat], max_output_tokens=16, temperature=0,
                                       input=[{"role": "user", "content": "What is the weather in Paris?"}, item,
                                              {"type": "function_call_output", "call_id": item.call_id,
                                               "output": "18 degrees, sunny"}])
    assert followed.status in ("completed", "incomplete") and followed.output


@pytest.mark.slow
@DEFAULT_PLACEMENT_ONLY
def test_a_repeated_prompt_reuses_its_prefix(url, engine):
    """Prefix caching on the default config: a prompt sent again prefills only its last token, usage says so (OpenAI's
    ``prompt_tokens_details.cached_tokens``), and the answer is the first one's up to a near-tie."""
    body = chat_body("Name a large city in Africa.", max_tokens=12, return_token_ids=True)
    first, again = (httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).json() for _ in range(2))
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert again["usage"]["prompt_tokens"] == prompt_tokens
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": prompt_tokens - 1}
    ids = engine.encode_chat(body["messages"])
    check_same_or_near_tie(engine, ids, first["token_ids"], again["token_ids"])


@pytest.mark.slow
@DEFAULT_PLACEMENT_ONLY
def test_the_next_turn_of_a_chat_reuses_the_previous_prompt_and_answer(url, engine):
    """A finished request's answer stays in the prefix cache: the second turn, sent with the first answer's text,
    prefills only what follows the answer's last token (committed without being run)."""
    first = chat_body("Name two planets.", max_tokens=12, return_token_ids=True, ignore_eos=True)
    reply = httpx.post(f"{url}/v1/chat/completions", json=first, timeout=300).json()
    answer = reply["choices"][0]["message"]["content"]
    messages = first["messages"] + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]
    ids = engine.encode_chat(messages)
    prompt, answer_ids = reply["usage"]["prompt_tokens"], reply["token_ids"]
    assert ids[: prompt + len(answer_ids)] == engine.encode_chat(first["messages"]) + answer_ids  # template round trip
    second = httpx.post(f"{url}/v1/chat/completions", json={**chat_body("Why?"), "messages": messages}, timeout=300)
    second = second.json()
    assert second["usage"]["prompt_tokens"] == len(ids)
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": prompt + len(answer_ids) - 1}


NEWLINE = 198  # SmolLM2's "\n" token
ALLOWED = tuple(range(200, 1200))  # 1,000 of SmolLM2's first merges (" t", " a", "in", ...): no special token, no byte
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}
# (client arguments, the SamplingParams the server must apply): greedy, so speculation on and off must agree
CONTROLS = {
    "presence_penalty": ({"presence_penalty": 1.5}, {"presence_penalty": 1.5}),
    "frequency_penalty": ({"frequency_penalty": 1.5}, {"frequency_penalty": 1.5}),
    "repetition_penalty": ({"extra_body": {"repetition_penalty": 1.5}}, {"repetition_penalty": 1.5}),
    "logit_bias": ({"logit_bias": {str(NEWLINE): -100}}, {"logit_bias": {NEWLINE: -100.0}}),
    "top_k_min_p": ({"extra_body": {"top_k": 3, "min_p": 0.2}}, {"top_k": 3, "min_p": 0.2}),
    "min_tokens": ({"extra_body": {"min_tokens": 20}}, {"min_tokens": 20}),
    "stop_token_ids": ({"extra_body": {"stop_token_ids": [NEWLINE]}}, {"stop_token_ids": (NEWLINE,)}),
    "bad_words": ({"extra_body": {"bad_words": ["Apple", "Banana"]}}, {"bad_words": ("Apple", "Banana")}),
    "allowed_token_ids": ({"extra_body": {"allowed_token_ids": list(ALLOWED)}}, {"allowed_token_ids": ALLOWED}),
    "logprobs": ({"logprobs": True, "top_logprobs": 3}, {"logprobs": 3}),
}


@pytest.mark.slow
@DEFAULT_PLACEMENT_ONLY
def test_openai_client_sampling_controls_equal_plain_decoding(url, engine):
    """Each sampling control and logprobs through the official client on the speculating server equal plain decoding
    of the same params in this process (speculation off), up to near-ties of the processed logits; a json_schema
    answer parses, matches the schema and equals plain decoding too, and so does a ``structured_outputs`` choice."""
    import openai

    from app.engine.types import GuidedDecoding

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
    prompt = "List three fruits, one per line, then say which is sweetest."
    ids = engine.encode_chat([{"role": "user", "content": prompt}])

    def served(**kwargs):
        extra = {"return_token_ids": True, **kwargs.pop("extra_body", {})}
        return client.chat.completions.create(model="smollm2-135m", temperature=0, max_tokens=24, extra_body=extra,
                                              messages=[{"role": "user", "content": prompt}], **kwargs)

    controls = {name: SamplingParams(max_tokens=24, **param_args) for name, (_, param_args) in CONTROLS.items()}
    plain_results, _ = generate(engine, [ids] * len(controls), list(controls.values()))  # one batch, no speculation
    with ThreadPoolExecutor(len(CONTROLS)) as pool:  # the served requests at once: the server batches them too
        responses = list(pool.map(lambda args: served(**args), [dict(a) for a, _ in CONTROLS.values()]))
    for (name, params), plain, response in zip(controls.items(), plain_results, responses):
        got = response.model_extra["token_ids"]
        check_same_or_near_tie(engine, ids, plain.token_ids, got, params)
        if name == "logit_bias":
            assert NEWLINE not in got
        if name == "stop_token_ids" and NEWLINE in got:
            assert got[-1] == NEWLINE and response.choices[0].finish_reason == "stop"
            assert response.choices[0].model_extra["stop_reason"] == NEWLINE  # vLLM's: the stop token id
        if name == "allowed_token_ids":  # no EOS among them: the answer runs to max_tokens
            assert set(got) <= set(ALLOWED) and response.choices[0].finish_reason == "length"
        if name == "logprobs" and got == plain.token_ids:
            content = response.choices[0].logprobs.content
            assert len(content) == len(got) and all(len(c.top_logprobs) == 3 for c in content)
            for c, ref in zip(content, plain.logprobs):
                assert abs(c.logprob - ref.logprob) <= 0.25 + 0.03 * abs(ref.logprob)
    schema_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    params = SamplingParams(max_tokens=24, guided=GuidedDecoding("json_schema", json.dumps(SCHEMA)))
    (plain,), _ = generate(engine, [ids], params)
    response = served(response_format=schema_format)
    assert response.model_extra["token_ids"] == plain.token_ids
    assert json.loads(response.choices[0].message.content).keys() == {"answer"}
    # response_format on completions too (vLLM's), with the text prompt tokenized as the engine does
    params = SamplingParams(max_tokens=24, guided=GuidedDecoding("json_object"))
    (plain,), _ = generate(engine, [engine.encode(prompt, add_special_tokens=True)], params)
    response = client.completions.create(model="smollm2-135m", prompt=prompt, temperature=0, max_tokens=24,
                                         extra_body={"response_format": {"type": "json_object"},
                                                     "return_token_ids": True})
    assert response.model_extra["token_ids"] == plain.token_ids and response.choices[0].text.lstrip()[0] == "{"
    # vLLM's structured_outputs: a choice as plain decoding picks it; a regex that does not compile is a 400 naming it
    choices = ["apple", "banana", "cherry"]
    params = SamplingParams(max_tokens=24, guided=GuidedDecoding("choice", json.dumps(choices)))
    (plain,), _ = generate(engine, [ids], params)
    response = served(extra_body={"structured_outputs": {"choice": choices}})
    assert response.choices[0].message.content in choices and response.model_extra["token_ids"] == plain.token_ids
    with pytest.raises(openai.BadRequestError, match="unclosed group") as err:
        served(extra_body={"structured_outputs": {"regex": "(unclosed"}})
    assert err.value.body["param"] == "structured_outputs"
