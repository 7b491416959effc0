"""Sampling controls under speculation: equality with plain decoding and the accepted length, per control.

Usage: ``python -m app.engine.bench_controls [--model smollm2-135m] [--tokens 48] [--gamma 5] [--prompts 6]
[--temperature 0.7]``

For each control (greedy, or sampled with ``--temperature``: each prompt then carries its own ``seed``, so the
outputs with and without speculation are the same tokens up to near-ties of the target's logits), a handful of chat
prompts are decoded without speculation and with the prompt-lookup n-gram drafter; the table gives how many outputs
are token-identical and tau (committed tokens per verify round) with speculation, and the draft tokens proposed and
verified (the engine cuts a block to the request's remaining ``max_tokens`` room and, with a grammar, before the
first draft the grammar forbids). An output that differs is judged by the near-tie rule on the processed logits
(``app/engine/near_tie.py``): ``near-tie`` counts rounding differences, ``bugs`` anything else. For
``json_schema`` it adds how many outputs that ended (not cut by ``max_tokens``) parse and match the schema, with
and without speculation. Prints the table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json

import jsonschema

from app.argtypes import non_negative_float, positive_int
from app.drafters.ngram import NgramProposer
from app.loop import RequestResult, generate
from app.engine.config import EngineConfig
from app.engine.engine import TargetEngine
from app.engine.near_tie import first_divergence
from app.engine.types import DraftBlock, FinishReason, GuidedDecoding, SamplingParams, batch_accepted_length

PROMPTS = [
    "Write a short poem about the sea, repeating the line 'the sea, the sea' in every stanza.",
    "List the first ten multiples of 7, one per line, as '7 x n = m'.",
    "Write a Python function that returns the sum of the squares of a list of numbers.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Explain in two sentences why the sky is blue.",
    "What is 2+3? Answer with the number only.",
]
JSON_PROMPTS = [
    "Describe a person as JSON with a name, an age and a favourite pet.",
    "Give me JSON for a character in a fantasy novel: name, age, pet.",
    "Return a JSON record of a customer named Ada who is 36 and owns a dog.",
    "Invent a user profile as JSON (name, age, pet).",
    "Make up a JSON object for a child with a cat.",
    "JSON please: someone called Bob, aged 70, with a fish.",
]
ALLOWED_BELOW = 4096  # allowed_token_ids: the ids below this (a small vocabulary's worth, EOS among them)
BAD_WORDS = ("the", "is")  # bad_words: words the answers use often
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "pet": {"enum": ["cat", "dog", "fish"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}


class CountingProposer(NgramProposer):
    """The n-gram drafter, counting the draft tokens it proposes."""

    proposed: int = 0

    def propose(self, request_ids):
        blocks: list[DraftBlock] = super().propose(request_ids)
        self.proposed += sum(b.length for b in blocks)
        return blocks


def controls(engine: TargetEngine, max_tokens: int) -> dict[str, dict]:
    """Control name -> SamplingParams fields (greedy) for requests of ``max_tokens`` tokens."""
    comma, period = engine.encode(",")[0], engine.encode(".")[0]
    return {
        "none": {},
        "presence_penalty": {"presence_penalty": 1.5},
        "frequency_penalty": {"frequency_penalty": 1.0},
        "repetition_penalty": {"repetition_penalty": 1.3},
        "logit_bias": {"logit_bias": ((comma, -100.0), (period, -100.0))},
        "top_k+min_p": {"top_k": 5, "min_p": 0.2},
        "min_tokens": {"min_tokens": max(1, max_tokens // 2)},
        "stop_token_ids": {"stop_token_ids": (period,)},
        "allowed_token_ids": {"allowed_token_ids": tuple(range(ALLOWED_BELOW))},
        "bad_words": {"bad_words": BAD_WORDS},
        "logprobs": {"logprobs": 5},
        "json_schema": {"guided": GuidedDecoding("json_schema", json.dumps(SCHEMA))},
    }


def _valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def _validity(results: list[RequestResult]) -> str:
    """``valid/ended``: outputs that parse and match SCHEMA among those that ended by themselves."""
    ended = [r for r in results if r.finish_reason == FinishReason.STOP]
    return f"{sum(_valid(r.text) for r in ended)}/{len(ended)}"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=positive_int, default=48, help="max_tokens per request")
    ap.add_argument("--gamma", type=positive_int, default=5, help="n-gram drafter block size")
    ap.add_argument("--prompts", type=positive_int, default=len(PROMPTS),
                    help=f"prompts per control (at most {len(PROMPTS)})")
    ap.add_argument("--temperature", type=non_negative_float, default=0.0,
                    help="0: greedy; > 0: sampled, seeded per prompt")
    args = ap.parse_args(argv)
    if args.prompts > min(len(PROMPTS), len(JSON_PROMPTS)):
        ap.error(f"--prompts {args.prompts}: there are {min(len(PROMPTS), len(JSON_PROMPTS))} prompts per control")

    try:
        engine = TargetEngine(EngineConfig(model=args.model, max_num_seqs=8, max_draft_len=args.gamma))
    except (FileNotFoundError, ValueError) as e:
        ap.error(f"the engine refuses these flags: {e}")
    rows = {}
    print(f"{'control':>20} {'identical':>10} {'near-tie':>9} {'bugs':>5} {'tau':>6} {'proposed':>9} {'verified':>9} "
          f"{'valid off':>10} {'valid on':>9}")
    for name, fields in controls(engine, args.tokens).items():
        texts = (JSON_PROMPTS if name == "json_schema" else PROMPTS)[: args.prompts]
        prompts = [engine.encode_chat([{"role": "user", "content": t}]) for t in texts]
        params = [SamplingParams(max_tokens=args.tokens, temperature=args.temperature,
                                 seed=i if args.temperature > 0 else None, **fields) for i in range(len(prompts))]
        plain, _ = generate(engine, prompts, params)
        proposer = CountingProposer(gamma=args.gamma)
        spec, _ = generate(engine, prompts, params, proposer=proposer)
        divergences = [first_divergence(engine, p, a.token_ids, b.token_ids, q)
                       for p, q, a, b in zip(prompts, params, plain, spec)]
        row = {
            "identical": sum(d is None for d in divergences),
            "near_tie": sum(d is not None and d.near_tie for d in divergences),
            "bugs": [d.describe() for d in divergences if d is not None and not d.near_tie],
            "prompts": len(prompts),
            "tau": round(batch_accepted_length(spec), 3),
            "proposed": proposer.proposed,
            "verified": sum(r.num_draft for r in spec),
        }
        if name == "json_schema":
            row["valid_off"], row["valid_on"] = _validity(plain), _validity(spec)
        rows[name] = row
        valid = f"{row['valid_off']:>10} {row['valid_on']:>9}" if "valid_on" in row else ""
        print(f"{name:>20} {row['identical']:>6}/{row['prompts']:<3} {row['near_tie']:>9} {len(row['bugs']):>5} "
              f"{row['tau']:>6.2f} {row['proposed']:>9} {row['verified']:>9} {valid}")
    result = {"model": args.model, "max_tokens": args.tokens, "gamma": args.gamma, "prompts": args.prompts,
              "temperature": args.temperature, "controls": rows}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
