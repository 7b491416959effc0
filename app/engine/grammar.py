"""Structured output: grammars (llguidance) and their token masks over a whole draft block.

Owns: compiling a ``GuidedDecoding`` (``json_object``: any JSON object; ``json_schema``: JSON matching the schema;
``regex``; ``choice``: one of a list of strings; ``grammar``: Lark or GBNF) into an llguidance matcher, once per
distinct grammar (cached; each request gets a copy), and per request the masks of one verify step. Does not own:
applying a mask to logits (``app/engine/logits_process.py``) or deciding which tokens are committed
(``app/engine/engine.py``).

Verification needs the mask of row i as if drafts 1..i were committed (row 0 follows the pending token).
``RequestGrammar.block_masks`` advances the matcher tentatively over the draft, one mask per row, stops at the
first draft token the grammar forbids and rolls the matcher back. The block is cut before that token (target
probability 0: it would be rejected) when the accept rule does not read a draft distribution: greedy, seeded
(Gumbel-max coupling) and point-mass drafts (prompt lookup) come out the same either way. Rejection sampling against
a draft distribution q keeps the token (``through_forbidden``): it must be rejected there and the output drawn
from the residual (p - q)+, not from p, or the output is biased towards the tokens q favours; the row after it
repeats its mask (it is never reached). The matcher advances for good only in ``RequestGrammar.commit``, on
committed tokens.

An end token (EOS) the grammar allows ends the request when committed (``ignore_eos`` is refused with a grammar),
so a draft is cut after one and the row after it allows EOS only: that row is never committed, it only keeps the
distribution defined.

With ``allowed_token_ids`` (which must then hold an EOS) each mask keeps only those tokens, so a draft outside them is
cut like any the grammar forbids. A state where no token is left (the grammar wants only tokens outside the set) is a
``GrammarError`` like the parser giving up: at the committed state it ends the request, at a draft it cuts the block
before that draft, so the request ends where plain decoding would end it.

Shape symbols: l verified draft tokens, V vocabulary, W = ceil(V / 32) words of a packed bitmask.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Sequence

import llguidance
import llguidance.gbnf_to_lark
import llguidance.numpy
import torch

from app.engine.errors import InvalidRequestError
from app.engine.types import GuidedDecoding

JSON_OBJECT_SCHEMA = '{"type": "object"}'  # json_object: any JSON object
# Whitespace between JSON tokens: at most 24 characters (a newline and indentation 11 levels deep at 2 spaces). JSON
# itself allows any amount, and a small model can pad a value forever; Outlines bounds it for the same reason.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,24}"
GRAMMAR_CACHE_SIZE = 64  # distinct compiled grammars kept per engine
GBNF_RULE = re.compile(r"^\s*[A-Za-z_][\w-]*\s*::=", re.MULTILINE)  # a GBNF rule; Lark writes "name:"


class GrammarError(RuntimeError):
    """llguidance stopped following a request's grammar (its parser gave up, e.g. ``ParserTooComplex`` past its
    per-step limit, after which its masks no longer hold), or the grammar and the request's ``allowed_token_ids``
    leave no token: that request cannot go on, the others of its step can."""


class GrammarCompiler:
    """Compiles ``GuidedDecoding`` values for one tokenizer; hands out one ``RequestGrammar`` per request.

    Args:
        tokenizer: the target's Hugging Face fast tokenizer.
        vocab_size: V, the model's vocabulary (may exceed the tokenizer's; extra ids are never allowed).
        eos_token_ids: tokens that end a request; the grammar allows them once its output is complete.
    """

    def __init__(self, tokenizer, *, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        import llguidance.hf  # imports transformers: only processes that compile grammars pay for it

        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        # about 0.4 s for SmolLM2's 49152-token vocabulary, once per engine
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self._compiled = functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)(self._compile)

    def matcher(self, guided: GuidedDecoding, *, allowed_token_ids: Sequence[int] | None = None) -> "RequestGrammar":
        """A fresh per-request grammar state for ``guided``, its masks kept to ``allowed_token_ids`` (ids in [0, V))
        when given.

        Raises:
            InvalidRequestError: a schema that is not valid JSON, a schema, regex or grammar llguidance does not
                compile (the message is llguidance's), or one no output satisfies.
        """
        return RequestGrammar(self._compiled(guided).deep_copy(), self, allowed_token_ids=allowed_token_ids)

    def _compile(self, guided: GuidedDecoding) -> llguidance.LLMatcher:
        what = "schema" if guided.kind.startswith("json") else guided.kind
        grammar = _grammar(guided)
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise InvalidRequestError(f"{guided.kind}: unsupported {what}: {error}", param="guided")
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"{guided.kind}: unsupported {what}: {matcher.get_error()}", param="guided")
        probe = matcher.deep_copy()  # the first mask tells whether anything but the end token may come
        llguidance.numpy.fill_next_token_bitmask(probe, llguidance.numpy.allocate_token_bitmask(1, self.vocab_size))
        if probe.is_stopped():  # e.g. a $ref that only refers to itself (llguidance: an error state too)
            output = "JSON value" if what == "schema" else "text"
            raise InvalidRequestError(f"{guided.kind}: the {what} admits no {output}", param="guided")
        return matcher


def _grammar(guided: GuidedDecoding) -> str:
    """llguidance's grammar for ``guided`` (its ``validate_grammar`` checks it).

    Raises:
        InvalidRequestError: a JSON schema that is not a JSON object, a GBNF grammar that does not parse.
    """
    if guided.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(guided.spec)
    if guided.kind == "grammar" and GBNF_RULE.search(guided.spec):  # GBNF: llama.cpp's, xgrammar's EBNF
        try:
            lark = llguidance.gbnf_to_lark.gbnf_to_lark(guided.spec)
        except Exception as e:  # its parser raises bare Exceptions for a rule it does not find
            raise InvalidRequestError(f"grammar: not a GBNF grammar llguidance reads: {e}", param="guided") from None
        return llguidance.LLMatcher.grammar_from_lark(lark)
    if guided.kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(guided.spec)
    if guided.kind == "choice":  # Lark string literals take JSON's escapes
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, json.loads(guided.spec))))
    schema = guided.spec if guided.kind == "json_schema" else JSON_OBJECT_SCHEMA
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_pattern": JSON_WHITESPACE})
    except ValueError as e:
        raise InvalidRequestError(f"{guided.kind}: the schema is not a JSON object: {e}", param="guided") from None


class RequestGrammar:
    """One request's grammar state (module docstring): the matcher holds the committed output only."""

    def __init__(self, matcher: llguidance.LLMatcher, compiler: GrammarCompiler, *,
                 allowed_token_ids: Sequence[int] | None = None) -> None:
        self._matcher = matcher
        self._allowed = None  # [V] bool, the request's allowed_token_ids, or None for every token
        if allowed_token_ids is not None:
            self._allowed = torch.zeros(compiler.vocab_size, dtype=torch.bool)
            self._allowed[list(allowed_token_ids)] = True
        self._vocab_size = compiler.vocab_size
        self._eos = frozenset(compiler.eos_token_ids)
        # [1, W] int32, the tensor sharing the array's memory (llguidance's numpy helpers: importing its torch module
        # compiles a kernel, which loads torch's compiler stack into every replica process)
        self._bitmask_np = llguidance.numpy.allocate_token_bitmask(1, compiler.vocab_size)
        self._bitmask = torch.from_numpy(self._bitmask_np)
        self._shifts = torch.arange(32, dtype=torch.int32)

    def block_masks(self, draft: Sequence[int], *, through_forbidden: bool = False) -> tuple[int, torch.Tensor]:
        """The tokens allowed at each row of a verify step over ``draft`` (module docstring).

        Args:
            draft: the l draft token ids proposed after the pending token.
            through_forbidden: keep the first forbidden draft too (rejection sampling against a draft
                distribution); the row after it repeats its row.

        Returns:
            ``(kept, allowed)``: the number of leading drafts kept (the block is cut to them) and ``allowed``
            [kept + 1, V] bool, row i the tokens the grammar allows after the committed output + drafts 1..i (a kept
            forbidden draft's row repeats the row before it).

        The drafts advance the matcher tentatively: a copy of it taken first is put back after, so a draft the
        parser gives up on (an error state is permanent in llguidance) cuts the block there and leaves the committed
        state as it was: speculation ends no request plain decoding would go on with.

        Raises:
            GrammarError: the parser gave up on the committed state (its mask cannot be computed), or no token of
                ``allowed_token_ids`` may follow it.
        """
        rows, kept = [self._mask()], 0
        if not draft:
            return 0, rows[0][None]
        committed = self._matcher.deep_copy()
        try:
            for tok in draft:
                if not bool(rows[-1][tok]):
                    if through_forbidden:  # verified and rejected there (target probability 0); never gone past
                        kept += 1
                        rows.append(rows[-1])
                    break
                if tok in self._eos:  # ends the request if accepted: nothing after it can be committed
                    kept += 1
                    rows.append(self.eos_only())
                    break
                if not self._matcher.consume_token(tok):
                    raise GrammarError(f"grammar refused draft token {tok} that its mask allowed: "
                                       f"{self._matcher.get_error()}")
                rows.append(self._mask())
                kept += 1
        except GrammarError:  # the drafts verified up to the one the parser gave up on, or that leaves no token
            pass
        finally:
            self._matcher = committed
        return kept, torch.stack(rows)

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance over committed tokens (an end token last is skipped: it ends the request).

        Raises:
            GrammarError: a committed token the grammar refuses (its masks allowed it: the matcher gave up).
        """
        body = [t for t in tokens if t not in self._eos]
        if body and not self._matcher.consume_tokens(body):
            raise GrammarError(f"grammar refused committed tokens {body}: {self._matcher.get_error()}")

    def _mask(self) -> torch.Tensor:
        """[V] bool: the tokens allowed next in the matcher's current state (and in ``allowed_token_ids``).

        Raises:
            GrammarError: the parser gave up, or ``allowed_token_ids`` hold none of the tokens the grammar allows.
        """
        llguidance.numpy.fill_next_token_bitmask(self._matcher, self._bitmask_np)
        if self._matcher.is_error():
            raise GrammarError(f"structured output stopped: {self._matcher.get_error()}")
        bits = (self._bitmask[0].unsqueeze(-1) >> self._shifts) & 1  # [W, 32], bit j of word w is token 32 w + j
        mask = bits.reshape(-1)[: self._vocab_size].bool()
        if self._allowed is None:
            return mask
        mask &= self._allowed
        if not bool(mask.any()):
            raise GrammarError("structured output stopped: allowed_token_ids hold none of the tokens the grammar "
                               "allows next")
        return mask

    def eos_only(self) -> torch.Tensor:
        """[V] bool: the end tokens only (a request that ends: its grammar failed, or an accepted EOS draft)."""
        mask = torch.zeros(self._vocab_size, dtype=torch.bool)
        mask[list(self._eos)] = True
        return mask
