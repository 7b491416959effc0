"""The verification engine: per-request KV caches and batched, ragged, lossless verification of draft blocks.

Owns: request admission (validation, prefill into a free cache slot from the end of the longest prefix the prefix
cache holds: ``prefix_cache.py``), one-forward verification of a ragged batch (request r brings its pending token plus
``l_r`` draft tokens, ``l_r = 0`` is plain decoding), acceptance, EOS / stop-token / stop-string / max_tokens
handling, release. Works on token ids; text is produced only for the committed output. Sampling controls
(penalties, logit_bias, allowed_token_ids, top-k, min-p, min_tokens, grammars) apply at every verified row with the
state the request would have after the earlier drafts of its block (``app/engine/logits_process.py``,
``app/engine/grammar.py``), so speculation does not change the output. Does not own: what to draft
(``app/drafters``) or how much of it to verify (``app/scheduling``).

State per request: its slot, ``num_cached`` tokens in the slot's cache, and one *pending* token (committed,
returned to the caller, not yet run through the target). A verify step feeds ``[pending, d_1 .. d_l]`` at
positions ``num_cached ..``; after accepting ``a`` drafts the cache keeps ``a + 1`` of them and the bonus or
recovered token becomes the new pending token. Rejected positions stay in the slot but are masked and later
overwritten.
"""

from __future__ import annotations

import functools
import heapq
import inspect
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any, Sequence

import jinja2
import torch

from app.engine.config import EngineConfig
from app.engine.contract import Engine
from app.engine.coupling import NoiseRows, accept_coupled
from app.engine.detokenizer import IncrementalDetokenizer
from app.engine.errors import CapacityError, ContextLengthError, InvalidRequestError, UnknownRequestError
from app.engine.grammar import GrammarCompiler, GrammarError, RequestGrammar
from app.engine.greedy_head import ScreenedArgmax
from app.engine.loader import LoadedTarget, load_target
from app.engine.model import EAGER, Elementwise, KVCache, StepLayout, compile_problem, flash_varlen_problem
from app.engine.prefix_cache import MISS, PrefixCache, PrefixHit
from app.engine.prepack import PrepackedLinear, prepack_linears, prepack_supported
from app.engine.logits_process import RequestControls, sampling_probs, token_logprobs
from app.engine.sampling import Acceptance, accept_greedy, accept_sampled, accept_sampled_batch, target_probs
from app.engine.static_step import BucketedStep
from app.engine.types import (ChatTemplateOptions, DraftBlock, FinishReason, NewRequest, SamplingParams, StepOutput,
                              TokenLogprob)

log = logging.getLogger(__name__)

# Rows of float32 logits [rows, V] a request's prompt logprobs are computed from at a time (100 MB at V = 49,152),
# padded up to a multiple of PROMPT_LOGPROB_BUCKET: the LM head then meets 8 row counts, not one per prompt length
# (on the CPU each new count costs oneDNN a new primitive, ~1 MB held in its caches; a float32 row's values do not
# depend on the rows beside it: app/engine/prepack.py)
PROMPT_LOGPROB_ROWS, PROMPT_LOGPROB_BUCKET = 512, 64


@functools.cache
def _renderer_args(tokenizer_type: type) -> frozenset[str]:
    """The names Hugging Face's chat renderer takes itself (``apply_chat_template``'s arguments and the template's
    ``messages``): not template variables a request may set."""
    return (frozenset(inspect.signature(tokenizer_type.apply_chat_template).parameters) - {"self", "kwargs"}) | {
        "messages"}


@dataclass
class _Request:
    request_id: str
    slot: int
    params: SamplingParams
    prompt_len: int
    detok: IncrementalDetokenizer
    generator: torch.Generator
    controls: RequestControls | None = None  # set when the request has any sampling control
    grammar: RequestGrammar | None = None  # set for structured output
    failed: str | None = None  # why the request cannot go on (its grammar failed): it ends in the next commit
    noise: NoiseRows | None = None  # a seeded sampled request's coupling noise (``coupling.py``), made at first use
    num_cached: int = 0
    pending: int = -1
    output_ids: list[int] = field(default_factory=list)
    # with prefix caching: the feature rows of the tokens verify steps ran and kept ([a + 1, F] a step), so the slot's
    # record takes the answer when the request ends (``TargetEngine._keep_answer``)
    answer_rows: list[torch.Tensor] = field(default_factory=list)
    # until its prefill is done (over several calls with chunked prefill): the prompt [T] int64, and the feature rows
    # of the prompt tokens already in the slot ([n, F] pieces, the reused prefix's first)
    prompt: torch.Tensor | None = None
    prompt_rows: list[torch.Tensor] = field(default_factory=list)
    reused: int = 0  # prompt tokens whose keys/values came from the prefix cache
    # with SamplingParams.prompt_logprobs, until its prefill is done: the prompt tokens' logprobs so far
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def prefilling(self) -> bool:
        """Whether its prompt is not wholly in its slot yet (no first token, no verify step)."""
        return self.prompt is not None

    @property
    def screened(self) -> bool:
        """Whether the greedy screen may pick this request's tokens (plain greedy: no control, no logprobs)."""
        return not self.params.full_logits

    @property
    def plain_sampled(self) -> bool:
        """Whether a verify step on an accelerator decides this request with the step's other plain sampled requests
        in one batch there (``sampling.accept_sampled_batch``): sampled, unseeded, no control, grammar or logprobs."""
        p = self.params
        return not p.greedy and p.seed is None and self.controls is None and self.grammar is None and p.logprobs is None


class TargetEngine(Engine):
    """Target replica engine (module docstring), the real-model ``Engine``. Not thread-safe: one caller drives it.

    Attributes:
        vocab_size: V.
        feature_dim: F, the width of ``StepOutput.features`` rows.
        eos_token_ids: tokens that end a request (unless ``ignore_eos``).
        prepacked: whether the decoder's linear layers run on oneDNN-prepacked weights (``app/engine/prepack.py``).
        attention: "flash" or "sdpa", ``config.attention`` resolved (``EngineConfig.attention``).
        compile_elementwise: whether the decoder's elementwise work runs compiled, ``config.compile_elementwise``
            resolved (``EngineConfig.compile_elementwise``).
    """

    def __init__(self, config: EngineConfig | None = None, *, loaded: LoadedTarget | None = None) -> None:
        self.config = config or EngineConfig()
        c = self.config
        self.target = loaded or load_target(
            c.model, dtype=c.dtype, device=c.device, feature_layers=c.feature_layers, fp32_lm_head=c.fp32_lm_head,
            load_format=c.load_format,
        )
        self.model = self.target.model
        self.tokenizer = self.target.tokenizer
        self.eos_token_ids = frozenset(self.target.eos_token_ids)
        args = self.model.args
        if c.max_model_len > args.max_position_embeddings:
            raise ValueError(f"max_model_len {c.max_model_len} exceeds the model's context limit "
                             f"{args.max_position_embeddings} (ModelArgs.max_position_embeddings: its own, or its "
                             "sliding window)")
        self.vocab_size = args.vocab_size
        self.feature_dim = self.model.feature_dim
        self.device = self.model.embed_tokens.weight.device
        self.attention = self._attention_backend()
        # a slot holds a draft block past the context limit: the padding of a verify step's last rows lands there
        self.cache = KVCache(
            args, num_slots=c.max_num_seqs, max_len=c.max_model_len + c.max_draft_len,
            dtype=self.model.embed_tokens.weight.dtype, device=self.device, token_major=self.attention == "flash",
        )
        self._groups = args.num_heads // args.num_kv_heads
        self._ops = self._elementwise()
        self.compile_elementwise = self._ops is not EAGER
        self._bucketed = None if c.verify_step == "ragged" else BucketedStep(
            self.model, self.cache, max_tokens=c.max_draft_len + 1, max_keys=c.max_model_len,
            cuda_graphs=c.verify_step == "cuda_graphs",
            ops=self._ops)
        # the decoder only: a tied bfloat16 LM head stays the embedding's tensor; a shared target may come packed
        if c.prepack:
            prepack_linears(self.model.layers)
        self.prepacked = any(isinstance(m, PrepackedLinear) for m in self.model.layers.modules())
        self._screen = self._greedy_screen()
        head = self.model.lm_head.weight
        if c.prepack and head.dtype == torch.float32 and prepack_supported(self.device, head.dtype):
            self.model.lm_head = PrepackedLinear(head, keep_weight=True)  # the screen rescores rows of the plain one
        # A verify step decides its plain sampled requests in one batch on an accelerator (``_sample_plain``); on a CPU
        # request by request, measured faster there: each request's [l + 1, V] rows stay in cache, and a batch's
        # large temporaries are fresh pages every step.
        self._batch_sampling = self.device.type != "cpu"
        self._free_slots = list(range(c.max_num_seqs))
        self._prefix = PrefixCache(c.max_num_seqs) if c.prefix_caching else None
        self._requests: dict[str, _Request] = {}
        self._grammars: GrammarCompiler | None = None  # built on the first structured-output request

    def _attention_backend(self) -> str:
        """``config.attention`` resolved: "flash" or "sdpa" (``EngineConfig.attention``).

        Raises:
            ValueError: ``attention: flash`` where ``flash_varlen_problem`` names a problem.
        """
        if self.config.attention == "sdpa":
            return "sdpa"
        problem = flash_varlen_problem(self.model.args, device=self.device, dtype=self.model.embed_tokens.weight.dtype)
        if problem is None:
            return "flash"
        if self.config.attention == "flash":
            raise ValueError(f"attention 'flash' cannot run here: {problem}")
        if self.device.type == "cuda":
            log.warning("attention: SDPA with masks, not FlashAttention: %s", problem)
        return "sdpa"

    def _elementwise(self) -> Elementwise:
        """The decoder's elementwise functions as ``config.compile_elementwise`` resolves (compiled, and probed, or
        ``EAGER``; ``EngineConfig.compile_elementwise``).

        Raises:
            ValueError: ``compile_elementwise: true`` where ``compile_problem`` names a problem.
        """
        if self.config.compile_elementwise is False:
            return EAGER
        ops = Elementwise.compiled()
        problem = compile_problem(ops, self.model.args, device=self.device, dtype=self.model.embed_tokens.weight.dtype)
        if problem is None:
            return ops
        if self.config.compile_elementwise:
            raise ValueError(f"compile_elementwise cannot run here: {problem}")
        if self.device.type == "cuda":
            log.warning("compile_elementwise: eager elementwise kernels: %s", problem)
        return EAGER

    def _greedy_screen(self) -> ScreenedArgmax | None:
        """The screened greedy head when ``greedy_screen`` applies (see its description), else None."""
        head, embed = self.model.lm_head.weight, self.model.embed_tokens.weight
        if not (self.config.greedy_screen and head.dtype == torch.float32
                and embed.dtype in (torch.bfloat16, torch.float16)):
            return None
        screen = embed if self.model.args.tie_word_embeddings else head.to(embed.dtype)
        return ScreenedArgmax(head, screen, prepack=self.prepacked)

    # ------------------------------------------------------------------ requests

    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    @property
    def num_active(self) -> int:
        return len(self._requests)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def input_embeddings(self) -> torch.Tensor:
        return self.model.embed_tokens.weight

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def chat_template(self) -> str | dict[str, str] | None:
        """The Jinja chat template the engine renders chats with: ``config.chat_template``, else the tokenizer's (by
        name where it has several, as Hermes-2-Pro's ``default`` and ``tool_use``; None: a base model's, which has
        none)."""
        return self.config.chat_template or self.tokenizer.chat_template

    def encode_chat(self, messages: list[dict[str, Any]], *, add_special_tokens: bool = False,
                    options: ChatTemplateOptions = ChatTemplateOptions()) -> list[int]:
        """Token ids of a chat prompt through the model's own chat template, rendered as ``options`` say (the
        generation prompt appended, by default); ``add_special_tokens``: the template's text tokenized with the
        tokenizer's own special tokens added (a Llama tokenizer's BOS, which templates usually write themselves:
        vLLM's chat default is off).

        Raises:
            InvalidRequestError: (``param`` "prompt") the model has no chat template (a base model: its prompts are
                raw text), or the template refuses the messages (some models' templates raise on roles that do not
                alternate, or on a system message); (``continue_final_message``) the template does not keep the final
                message as sent, so it cannot be left open; (``chat_template_kwargs``) a name the renderer itself
                takes (``messages``, ``tokenize``, ...), or values the template cannot use; (``add_special_tokens``)
                with ``options.sanitize_control_tokens`` (Hugging Face's sanitizing tokenizes the template's text
                itself, without special tokens); (``tools``) the template never reads ``tools``, so the model would not
                see them (serve a template that shows tools: the serving config's ``chat_template``).
        """
        if not self.chat_template:
            raise InvalidRequestError(f"the model {self.config.model!r} has no chat template (its tokenizer "
                                      "defines none): send a raw prompt to /v1/completions", param="prompt")
        if reserved := sorted(set(options.template_kwargs) & _renderer_args(type(self.tokenizer))):
            raise InvalidRequestError(f"{reserved} are the chat renderer's own arguments, not template variables",
                                      param="chat_template_kwargs")
        render = dict(options.template_kwargs, add_generation_prompt=options.add_generation_prompt,
                      continue_final_message=options.continue_final_message)
        if self.config.chat_template is not None:
            render["chat_template"] = self.config.chat_template
        if options.tools is not None:
            tools = [dict(tool) for tool in options.tools]
            if "tools" not in self.tokenizer.get_chat_template(self.config.chat_template, tools):
                raise InvalidRequestError(f"the chat template of {self.config.model!r} does not show tools to the "
                                          "model; serve it with a template that does (the chat_template setting, e.g. "
                                          "deployments/templates/chatml_tools.jinja)", param="tools")
            render["tools"] = tools
        if options.sanitize_control_tokens:
            if add_special_tokens:
                raise InvalidRequestError("this server encodes control tokens in messages as text, which leaves the "
                                          "special tokens to the chat template", param="add_special_tokens")
            render["sanitize_control_tokens"] = True
        try:
            if add_special_tokens:
                text = self.tokenizer.apply_chat_template(messages, tokenize=False, **render)
                return self.encode(text, add_special_tokens=True)
            return list(self.tokenizer.apply_chat_template(messages, return_dict=False, **render))
        except jinja2.TemplateError as err:
            raise InvalidRequestError(f"the model's chat template refuses these messages: {err}",
                                      param="prompt") from None
        except ValueError as err:  # Hugging Face's: the final message is not in the rendered text as sent
            if not options.continue_final_message:
                raise
            raise InvalidRequestError("the model's chat template does not keep the final message as sent, so it "
                                      "cannot be continued", param="continue_final_message") from err
        except TypeError as err:  # a template variable of a type the template cannot use
            if not options.template_kwargs:
                raise
            raise InvalidRequestError(f"the chat template cannot use these variables: {err}",
                                      param="chat_template_kwargs") from err

    def bad_words_ids(self, words: Sequence[str]) -> list[list[int]]:
        """The token ids ``bad_words`` ban (vLLM's rule): each word, stripped of leading spaces, as it is tokenized
        alone, and after a space when that gives another first token and as many tokens (a word inside a text)."""
        out = []
        for word in words:
            alone = self.encode(word.lstrip())
            out.append(alone)
            spaced = self.encode(" " + word.lstrip())
            if spaced[0] != alone[0] and len(spaced) == len(alone):
                out.append(spaced)
        return out

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of a text; ``add_special_tokens``: with the tokenizer's own special tokens (a Llama tokenizer's
        BOS), as a raw completion prompt gets them by default (vLLM's and Hugging Face's rule)."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    @property
    def prefix_caching(self) -> bool:
        return self._prefix is not None

    def prefill_tokens(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> int:
        """T less the prefix the prefix cache would reuse for ``prompt_ids`` now (T without prefix caching, or for a
        request with ``prompt_logprobs``)."""
        if self._prefix is None or len(prompt_ids) < 2 or params is not None and params.whole_prompt:
            return len(prompt_ids)
        return len(prompt_ids) - self._prefix.match(torch.as_tensor(prompt_ids, dtype=torch.long)).length

    @property
    def supports_chunked_prefill(self) -> bool:
        """Whether ``add_requests`` takes ``limits``: everywhere but in batch-invariant mode (a prompt's keys/values
        would depend on where the caller cut it)."""
        return not self.config.batch_invariant

    def add_requests(self, requests: Sequence[NewRequest], *, limits: Sequence[int] | None = None
                     ) -> list[StepOutput | None]:
        """Validate every request, then prefill all their prompts in one ragged forward (batched prefill) and sample
        each first token.

        One forward over the concatenated prompts (``sum T`` rows) runs the linear layers once for all of them,
        which costs less than one forward per prompt. The caller bounds ``sum T`` (the step's activations and mask
        grow with it). With prefix caching (``EngineConfig.enable_prefix_caching``) a prompt that shares its first
        L tokens with what a slot holds (a prompt, or a finished request's prompt and answer) prefills only its last
        T - L tokens (``prefix_cache.py``); it takes the donor's slot when that slot is free and its whole record is in
        the prompt, else the free slot whose record was used least recently.

        Chunked prefill (``limits``, where ``supports_chunked_prefill``): request i computes at most ``limits[i]``
        prompt tokens now (after its reused prefix); a request whose prompt is not wholly in its slot then holds its
        slot, gets None instead of a StepOutput and goes on with ``continue_prefill``. The prompt's keys/values and
        features are those of a prefill in one piece, up to rounding (later pieces attend to the cached keys of
        earlier ones).

        Returns:
            One StepOutput per request, in order: the first token and the prompt's features ``[T, F]`` (None: a
            chunked prefill not done yet).

        Raises:
            InvalidRequestError: duplicate id (held, or twice in the batch), empty prompt, token id outside [0, V)
                (prompt, ``logit_bias``, ``stop_token_ids`` or ``allowed_token_ids``); ``allowed_token_ids`` of end
                tokens only (EOS, ``stop_token_ids``) under ``min_tokens``, which masks them; structured output
                (``guided``) llguidance does not compile, combined with ``ignore_eos`` or ``min_tokens``, or with
                ``allowed_token_ids`` that hold no EOS; ``bad_words`` with ``guided`` or ``allowed_token_ids``.
            ContextLengthError: T + max_tokens > max_model_len.
            CapacityError: fewer free slots than requests.
            ValueError: ``limits`` not one positive count per request, or given in batch-invariant mode.
            Validation errors name the first bad request; nothing is changed then.
        """
        if not requests:
            return []
        if limits is not None:
            if not self.supports_chunked_prefill:
                raise ValueError("chunked prefill is off in batch-invariant mode (batch_invariant: true)")
            if len(limits) != len(requests) or any(n < 1 for n in limits):
                raise ValueError(f"limits must be one count >= 1 per request, got {list(limits)} for "
                                 f"{len(requests)} requests")
        checked = [self._check_new(r) for r in requests]
        prompts = [ids for ids, _ in checked]
        if len({r.request_id for r in requests}) < len(requests):
            raise InvalidRequestError("the same request id appears twice in one admission batch")
        if len(requests) > len(self._free_slots):
            raise CapacityError(
                f"{len(requests)} requests for {len(self._free_slots)} free KV cache slots "
                f"(max_num_seqs {self.config.max_num_seqs})"
            )
        hits = [MISS] * len(prompts)
        if self._prefix is not None:
            hits = [MISS if r.params.whole_prompt else self._prefix.match(ids) for r, ids in zip(requests, prompts)]
        for hit in hits:  # this batch's donors are given out last: a request not taking its donor's goes elsewhere
            if hit.length:
                self._prefix.touch(hit.slot)
        reqs = [self._register(r, len(ids), grammar, donor=hit.slot if hit.whole else -1)
                for r, (ids, grammar), hit in zip(requests, checked, hits)]
        try:  # from here on the slots are taken: any failure gives them back
            if self._prefix is not None:
                self._reuse_prefixes(reqs, hits)
            for req, ids, hit in zip(reqs, prompts, hits):
                req.prompt, req.num_cached, req.reused = ids, hit.length, hit.length
                req.prompt_rows = [hit.features] if hit.length else []
                if req.params.prompt_logprobs is not None:
                    req.prompt_logprobs = [None]  # nothing predicts the first prompt token
            if self.config.batch_invariant:  # each prompt alone: its cache and first token do not depend on others
                return [out for i in range(len(reqs)) for out in self._prefill(reqs[i : i + 1])]
            return self._prefill(reqs, limits)
        except BaseException:
            for req in reqs:
                if req.request_id in self._requests:
                    self.release(req.request_id)
            raise

    def _reuse_prefixes(self, reqs: list[_Request], hits: list[PrefixHit]) -> None:
        """Drop the records of the slots just taken (their prefill writes them from the end of the reused prefix on),
        then copy each hit's shared keys/values from its donor slot (unless the request took that slot). Every donor
        is read before any slot is written, so a donor another request of the batch took is still intact when read."""
        for req in reqs:
            self._prefix.forget(req.slot)
        self.cache.copy_prefixes([(hit.slot, req.slot, hit.length) for req, hit in zip(reqs, hits)
                                  if hit.length and hit.slot != req.slot])

    def continue_prefill(self, limits: dict[str, int]) -> list[StepOutput | None]:
        """The next piece of chunked prefills (``add_requests`` with ``limits``), in one forward: request ``r``
        computes at most ``limits[r]`` more prompt tokens.

        Returns:
            Per request, in ``limits``' order, its first output once its prompt is wholly in its slot, else None.

        Raises:
            UnknownRequestError: a request not held. InvalidRequestError: a request whose prefill is done.
            ValueError: a count < 1. Nothing is changed then.
        """
        reqs = []
        for rid, n in limits.items():
            req = self._requests.get(rid)
            if req is None:
                raise UnknownRequestError(f"unknown request {rid!r} (never added, finished or released)")
            if not req.prefilling:
                raise InvalidRequestError(f"request {rid!r} has no prefill left to continue")
            if n < 1:
                raise ValueError(f"a prefill piece needs at least 1 token, got {n} for {rid!r}")
            reqs.append(req)
        return self._prefill(reqs, list(limits.values()))

    def _prefill(self, reqs: list[_Request], limits: Sequence[int] | None = None) -> list[StepOutput | None]:
        """One forward over the prefilling ``reqs``' prompts from the first token not in each one's slot, at most
        ``limits[i]`` tokens each (None: to the end); the first output of each request whose prompt is then wholly in
        its slot, else None, in order."""
        starts = [r.num_cached for r in reqs]
        ends = [len(r.prompt) if limits is None else min(len(r.prompt), start + n)
                for r, start, n in zip(reqs, starts, limits or [0] * len(reqs))]
        runs = [r.prompt[start:end] for r, start, end in zip(reqs, starts, ends)]
        lengths = [len(run) for run in runs]
        done = [i for i, r in enumerate(reqs) if ends[i] == len(r.prompt)]
        scored = [i for i, r in enumerate(reqs) if r.prompt_logprobs is not None]  # rows scored as prompt logprobs
        with torch.inference_mode():
            layout = StepLayout.build(
                slots=[r.slot for r in reqs], starts=starts, lengths=lengths, groups=self._groups,
                device=self.device, dtype=self.cache.k.dtype, slot_len=self.cache.slot_len,
            )
            ends_of_runs = torch.cumsum(torch.tensor(lengths), 0)
            last = (ends_of_runs - 1)[done].to(self.device)  # [B'] the last row of each finished prompt
            hidden, features = self.model.hidden_states(
                torch.cat(runs).to(self.device), cache=self.cache, layout=layout, index=None if scored else last,
                ops=self._ops,
            )
            for i in scored:  # row j of a run predicts the prompt token after it (the last row of a prompt: none)
                first = int(ends_of_runs[i]) - lengths[i]
                targets = reqs[i].prompt[starts[i] + 1 : ends[i] + 1].tolist()
                reqs[i].prompt_logprobs += self._prompt_logprobs(hidden[first : first + len(targets)], targets,
                                                                 reqs[i].params.prompt_logprobs)
            if scored:
                hidden = hidden[last]
            heads = {} if not done else dict(zip(done, self._head(hidden, [1] * len(done),
                                                                  [reqs[i].screened for i in done])))
        outputs: list[StepOutput | None] = []
        offset = 0
        empty = torch.zeros(0, dtype=torch.long)
        for i, (req, n) in enumerate(zip(reqs, lengths)):
            rows = features[offset : offset + n]  # [n, F]
            offset += n
            req.num_cached = ends[i]
            if i not in heads:  # a piece of a chunked prefill: its rows must outlive this step's features
                req.prompt_rows.append(rows.clone())
                outputs.append(None)
                continue
            ids, pieces = req.prompt, req.prompt_rows + [rows]
            if len(pieces) > 1:
                rows = torch.cat(pieces)
            elif self._prefix is not None:  # the record keeps the prompt's rows: its own tensor, not the batch's
                rows = rows.clone()
            if self._prefix is not None:
                self._prefix.store(req.slot, ids, rows)
            req.prompt, req.prompt_rows = None, []
            head = heads[i].cpu()
            allowed = self._block_masks(req, [])[1] if req.grammar is not None else None
            # the first token's position is T, the prompt's length (a verify step's row j: num_cached + 1 + j)
            result = self._decide(req, empty, None, head, allowed, first_position=len(ids))
            outputs.append(self._commit(req, result.tokens, num_draft=0, num_accepted=0, features=rows, head=head,
                                        cached_tokens=req.reused, prompt_logprobs=req.prompt_logprobs))
            req.prompt_logprobs = None
        return outputs

    def _prompt_logprobs(self, hidden: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprob]:
        """The raw target's logprobs of prompt tokens ``targets``, their ranks and top-k alternatives, from the
        last-layer hidden states [n, Dm] of the rows before them (row j predicts ``targets[j]``),
        ``PROMPT_LOGPROB_ROWS`` rows of float32 logits [rows, V] at a time, in calls padded to
        ``PROMPT_LOGPROB_BUCKET`` rows."""
        out: list[TokenLogprob] = []
        for a in range(0, len(targets), PROMPT_LOGPROB_ROWS):
            rows = hidden[a : a + PROMPT_LOGPROB_ROWS]
            pad = -len(rows) % PROMPT_LOGPROB_BUCKET
            logits = self.model.logits_from_final_hidden(torch.cat([rows, rows.new_zeros(pad, rows.shape[1])]))
            out += token_logprobs(logits, targets[a : a + PROMPT_LOGPROB_ROWS], k, ranks=True)
        return out

    def _check_new(self, request: NewRequest) -> tuple[torch.Tensor, RequestGrammar | None]:
        """A new request's prompt as [T] int64 and its grammar state (structured output only), after the checks
        ``add_requests`` documents (but capacity)."""
        if request.request_id in self._requests:
            raise InvalidRequestError(f"request {request.request_id!r} already exists")
        if len(request.prompt_ids) == 0:
            raise InvalidRequestError("prompt is empty", param="prompt")
        p = request.params
        for param, ids in (("logit_bias", [t for t, _ in p.logit_bias]), ("stop_token_ids", p.stop_token_ids),
                           ("allowed_token_ids", p.allowed_token_ids or ())):
            if bad := [t for t in ids if t >= self.vocab_size]:
                raise InvalidRequestError(f"{param}: token ids {bad} are outside [0, {self.vocab_size})", param=param)
        if p.min_tokens and p.allowed_token_ids is not None:  # RequestControls masks the end tokens under min_tokens
            ends = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
            if ends.issuperset(p.allowed_token_ids):
                raise InvalidRequestError(
                    f"allowed_token_ids {list(p.allowed_token_ids)} are all end tokens (EOS or stop_token_ids), which "
                    f"min_tokens={p.min_tokens} masks: no token could be generated", param="allowed_token_ids")
        if p.bad_words and (p.guided is not None or p.allowed_token_ids is not None):
            raise InvalidRequestError("bad_words with structured output or allowed_token_ids could leave no token to "
                                      "generate: send one of them", param="bad_words")
        ids = torch.as_tensor(request.prompt_ids, dtype=torch.long)
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        self.check_context(len(ids), request.params.max_tokens)
        return ids, self._grammar(p)

    def check_context(self, prompt_tokens: int, max_tokens: int) -> None:
        ContextLengthError.check(prompt_tokens=prompt_tokens, max_tokens=max_tokens, limit=self.config.max_model_len)

    def _grammar(self, params: SamplingParams) -> RequestGrammar | None:
        """A fresh grammar state for a structured-output request (None without ``guided``)."""
        if params.guided is None:
            return None
        if params.ignore_eos or params.min_tokens:
            raise InvalidRequestError(
                f"structured output ({params.guided.kind}) ends at EOS once its output is complete: it cannot be "
                f"combined with ignore_eos or min_tokens (got ignore_eos={params.ignore_eos}, "
                f"min_tokens={params.min_tokens})", param="guided"
            )
        if params.allowed_token_ids is not None and self.eos_token_ids.isdisjoint(params.allowed_token_ids):
            raise InvalidRequestError(
                f"structured output ({params.guided.kind}) ends at EOS once its output is complete: allowed_token_ids "
                f"must hold an EOS token ({sorted(self.eos_token_ids)})", param="allowed_token_ids"
            )
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, vocab_size=self.vocab_size,
                                             eos_token_ids=sorted(self.eos_token_ids))
        return self._grammars.matcher(params.guided, allowed_token_ids=params.allowed_token_ids)

    def _register(self, request: NewRequest, prompt_len: int, grammar: RequestGrammar | None, *, donor: int = -1
                  ) -> _Request:
        """Take a free slot for a validated request (``donor`` if that one is free, else ``_take_slot``'s choice),
        with its own generator, detokenizer and control state."""
        params = request.params
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        controls = (RequestControls(params, request.prompt_ids, eos_token_ids=sorted(self.eos_token_ids),
                                    vocab_size=self.vocab_size, bad_words_ids=self.bad_words_ids(params.bad_words))
                    if params.controls() else None)
        req = _Request(request_id=request.request_id, slot=self._take_slot(donor), params=params,
                       prompt_len=prompt_len, detok=IncrementalDetokenizer.for_request(self.tokenizer, params),
                       generator=torch.Generator().manual_seed(seed), controls=controls, grammar=grammar)
        self._requests[request.request_id] = req
        return req

    def _take_slot(self, preferred: int) -> int:
        """Remove ``preferred`` from the free slots if it is there, else, with prefix caching, the slot whose record
        was used least recently (``PrefixCache.least_recent``), else the lowest free slot; return it."""
        if preferred not in self._free_slots and self._prefix is not None:
            preferred = self._prefix.least_recent(self._free_slots)
        if preferred in self._free_slots:
            self._free_slots.remove(preferred)
            heapq.heapify(self._free_slots)
            return preferred
        return heapq.heappop(self._free_slots)

    def release(self, request_id: str) -> None:
        """Free a request's slot (finished, client gone, or cleanup after an error); with prefix caching the slot's
        record keeps the request's prompt and answer for a later prompt that continues them.

        Raises:
            UnknownRequestError: the id is not held (never added, finished or already released).
        """
        req = self._requests.pop(request_id, None)
        if req is None:
            raise UnknownRequestError(f"unknown request {request_id!r} (never added, finished or released)")
        if self._prefix is not None:
            self._keep_answer(req)
        heapq.heappush(self._free_slots, req.slot)

    def _keep_answer(self, req: _Request) -> None:
        """Extend the record of an ending request's slot (its prompt) with the answer tokens the slot holds: those
        verify steps ran and kept, as far as they are output (drafts accepted after a stop are not)."""
        answer = min(req.num_cached, req.prompt_len + len(req.output_ids)) - req.prompt_len
        if answer <= 0 or self._prefix.length(req.slot) != req.prompt_len:  # nothing run, or the prefill failed
            return
        tokens = torch.tensor(req.output_ids[:answer], dtype=torch.long)
        self._prefix.extend(req.slot, tokens, torch.cat(req.answer_rows)[:answer])
        req.answer_rows = []

    # ------------------------------------------------------------------ verification

    def verify(self, blocks: Sequence[DraftBlock]) -> list[StepOutput]:
        """One target forward over a ragged batch: each request's pending token plus its draft block.

        ``len(block.tokens) == 0`` (or ``verify_len == 0``) is a plain decoding step for that request. A block
        longer than the request's remaining ``max_tokens - 1`` is cut to it (those drafts could never count). A
        structured-output block is cut before its first draft the grammar forbids (target probability 0: it could
        never be accepted), or just after it when the request is verified by rejection sampling against draft
        probabilities (it must be rejected there: ``grammar.py``); ``StepOutput.num_draft`` counts the drafts
        actually verified.

        Returns:
            One StepOutput per block, in order. Finished requests are released.

        Raises:
            UnknownRequestError: a block names a request not held. Nothing is changed.
            InvalidRequestError: duplicate request in the batch, draft longer than ``max_draft_len``, a token id
                outside [0, V), or draft probabilities of the wrong shape (``DraftBlock``: dense [>= l, V], or sparse
                [>= l, S] with distinct ``prob_ids`` in [0, V) per row). Nothing is changed.
        """
        if not blocks:
            return []
        reqs, drafts = self._validate(blocks)
        masks: list[torch.Tensor | None] = []  # [l + 1, V] bool grammar masks per request, or None
        for i, req in enumerate(reqs):
            if req.grammar is None:
                masks.append(None)
                continue
            rejection = blocks[i].verified_against_probs(req.params)  # ``_decide`` reads q
            kept, allowed = self._block_masks(req, drafts[i].tolist(), through_forbidden=rejection)
            drafts[i] = drafts[i][:kept]
            masks.append(allowed)
        tokens, starts, lengths = [], [], []
        for req, draft in zip(reqs, drafts):
            tokens.append(torch.cat([torch.tensor([req.pending]), draft]))
            starts.append(req.num_cached)
            lengths.append(1 + len(draft))
        if self.config.batch_invariant:  # each request alone, always [max_draft_len + 1] rows over the whole slot
            steps = [self._forward(reqs[i : i + 1], tokens[i : i + 1], starts[i : i + 1], fixed=True)
                     for i in range(len(reqs))]
            heads = [h for step in steps for h in step[0]]
            features = torch.cat([step[1] for step in steps])
        else:
            heads, features = self._forward(reqs, tokens, starts)
        draft_probs = [block.dense_probs(self.vocab_size)[: len(draft)] if block.probs is not None else None
                       for block, draft in zip(blocks, drafts)]
        plain = [i for i, req in enumerate(reqs) if req.plain_sampled] if self._batch_sampling else []
        results: dict[int, Acceptance] = dict(zip(plain, self._sample_plain(
            [reqs[i] for i in plain], [drafts[i] for i in plain], [draft_probs[i] for i in plain],
            [heads[i] for i in plain])))
        outputs, offset = [], 0
        for i, (req, draft, n, head, allowed) in enumerate(zip(reqs, drafts, lengths, heads, masks)):
            if i not in results:
                head = head.cpu()
                results[i] = self._decide(req, draft, draft_probs[i], head, allowed,
                                          first_position=req.num_cached + 1)
            outputs.append(self._accept(req, draft, results[i], head, features[offset : offset + n]))
            offset += n
        return outputs

    def _sample_plain(
        self, reqs: list[_Request], drafts: list[torch.Tensor], draft_probs: list[torch.Tensor | None],
        logits: list[torch.Tensor],
    ) -> list[Acceptance]:
        """Rejection sampling of plain sampled requests (``_Request.plain_sampled``) in one batch where their logits
        are ([l_r + 1, V] each, on the engine's device): target distributions per (temperature, top_p) group, then
        ``accept_sampled_batch``. Outcomes equal ``_decide``'s for the same generators."""
        if not reqs:
            return []
        groups: dict[tuple[float, float], list[int]] = {}
        for i, req in enumerate(reqs):
            groups.setdefault((req.params.temperature, req.params.top_p), []).append(i)
        probs: list[torch.Tensor | None] = [None] * len(reqs)
        for (temperature, top_p), members in groups.items():
            rows = target_probs(torch.cat([logits[i] for i in members]), temperature=temperature, top_p=top_p)
            for i, part in zip(members, rows.split([len(logits[i]) for i in members])):
                probs[i] = part
        return accept_sampled_batch(drafts, draft_probs, torch.cat(probs), [r.generator for r in reqs])

    def _forward(
        self, reqs: list[_Request], tokens: list[torch.Tensor], starts: list[int], *, fixed: bool = False
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """One target forward over ``tokens`` (per request [n_r] int64, written at positions ``starts[r] ..``).

        With ``fixed`` (batch-invariant mode, one request) the run is padded to ``max_draft_len + 1`` rows and attends
        over the whole slot (``StepLayout.build``'s ``key_len``), so every verify step of every request has the same
        shapes and a row's logits depend on its own tokens and cache only. Padding rows write keys/values past the
        request's run, which stay masked until overwritten, like rejected drafts.

        Otherwise, with ``verify_step`` bucketed or cuda_graphs, the step runs in its bucketed static shape
        (``app/engine/static_step.py``).

        Returns:
            ``_head``'s output per request and the features [sum n_r, F] of the real rows.
        """
        lengths = [len(t) for t in tokens]
        greedy = [r.screened for r in reqs]
        if self._bucketed is not None and not fixed:
            with torch.inference_mode():
                hidden, features = self._bucketed.forward([r.slot for r in reqs], tokens, starts)
                return self._head(hidden, lengths, greedy), features
        if fixed:
            pad = self.config.max_draft_len + 1 - lengths[0]
            tokens = [torch.cat([tokens[0], tokens[0].new_zeros(pad)])]
        rows = [len(t) for t in tokens]
        with torch.inference_mode():
            layout = StepLayout.build(
                slots=[r.slot for r in reqs], starts=starts, lengths=rows, groups=self._groups, device=self.device,
                dtype=self.cache.k.dtype, key_len=self.cache.max_len if fixed else None,
                slot_len=self.cache.slot_len,
            )
            flat = torch.cat(tokens).to(self.device)
            hidden, features = self.model.hidden_states(
                flat, cache=self.cache, layout=layout, index=torch.arange(len(flat), device=self.device), ops=self._ops
            )
            heads = self._head(hidden, rows, greedy)
        if fixed:
            return [heads[0][: lengths[0]]], features[: lengths[0]]
        return heads, features

    def _head(self, hidden: torch.Tensor, lengths: list[int], greedy: list[bool]) -> list[torch.Tensor]:
        """The LM head over a step's rows, per request: greedy target tokens [n] int64 on the host where ``greedy``
        (plain greedy requests, ``_Request.screened``), float32 logits [n, V] on the engine's device for the others
        (sampled, or greedy with a sampling control or logprobs: those need every logit). hidden: [N, Dm],
        request-major, ``lengths`` rows per request."""
        rows = torch.repeat_interleave(torch.tensor(greedy), torch.tensor(lengths)).to(hidden.device)  # [N] bool
        if self._screen is not None:
            tokens = self._screen(self.model.final_norm(hidden[rows])) if any(greedy) else None
            logits = self.model.logits_from_final_hidden(hidden[~rows]) if not all(greedy) else None
        else:
            all_logits = self.model.logits_from_final_hidden(hidden)
            tokens, logits = all_logits[rows].argmax(-1), all_logits[~rows]
        tokens = tokens.cpu() if tokens is not None else None
        heads, done = [], {True: 0, False: 0}  # rows used so far of the greedy tokens / the sampled logits
        for n, g in zip(lengths, greedy):
            heads.append((tokens if g else logits)[done[g] : done[g] + n])
            done[g] += n
        return heads

    def _validate(self, blocks: Sequence[DraftBlock]) -> tuple[list[_Request], list[torch.Tensor]]:
        seen: set[str] = set()
        reqs, drafts = [], []
        for b in blocks:
            req = self._requests.get(b.request_id)
            if req is None:
                raise UnknownRequestError(f"unknown request {b.request_id!r} (never added, finished or released)")
            if b.request_id in seen:
                raise InvalidRequestError(f"request {b.request_id!r} appears twice in one verify batch")
            if req.prefilling:
                raise InvalidRequestError(f"request {b.request_id!r} is still being prefilled (continue_prefill)")
            seen.add(b.request_id)
            if b.length > self.config.max_draft_len:
                raise InvalidRequestError(
                    f"draft of {b.length} tokens for {b.request_id!r} exceeds max_draft_len {self.config.max_draft_len}"
                )
            remaining = req.params.max_tokens - len(req.output_ids)
            draft = b.tokens[: min(b.length, remaining - 1)].to(torch.long).cpu()
            if draft.numel() and (int(draft.min()) < 0 or int(draft.max()) >= self.vocab_size):
                raise InvalidRequestError(f"draft token ids of {b.request_id!r} must be in [0, {self.vocab_size})")
            if b.probs is not None:
                self._check_probs(b, len(draft))
            reqs.append(req)
            drafts.append(draft)
        return reqs, drafts

    def _check_probs(self, block: DraftBlock, length: int) -> None:
        """Raise InvalidRequestError unless ``block.probs`` covers ``length`` drafts: dense [>= l, V], or sparse
        [>= l, S] with ``prob_ids`` of the same shape holding distinct token ids in [0, V) per row."""
        probs, ids, rid = block.probs, block.prob_ids, block.request_id
        if ids is None:
            if probs.dim() != 2 or probs.shape[0] < length or probs.shape[1] != self.vocab_size:
                raise InvalidRequestError(
                    f"draft probs of {rid!r} must be [>= {length}, {self.vocab_size}], got {tuple(probs.shape)}"
                )
            return
        if probs.dim() != 2 or probs.shape != ids.shape or probs.shape[0] < length:
            raise InvalidRequestError(
                f"sparse draft probs of {rid!r} must be [>= {length}, S] with prob_ids of the same shape, got "
                f"{tuple(probs.shape)} and {tuple(ids.shape)}"
            )
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise InvalidRequestError(f"draft prob_ids of {rid!r} must be in [0, {self.vocab_size})")
        ordered = ids.sort(dim=-1).values
        if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
            raise InvalidRequestError(f"draft prob_ids of {rid!r} repeat a token id within a row")

    def _accept(
        self, req: _Request, draft: torch.Tensor, result: Acceptance, head: torch.Tensor, features: torch.Tensor
    ) -> StepOutput:
        """Commit the outcome ``result`` of verifying ``draft`` [l] against the target's ``head`` (``_head``: [l + 1]
        greedy tokens or [l + 1, V] logits); ``features`` [l + 1, F] are the block's rows."""
        req.num_cached += result.num_accepted + 1
        kept = features[: result.num_accepted + 1]
        if self._prefix is not None:  # its own tensor: the step's would be held for the request's life
            kept = kept.clone()
            req.answer_rows.append(kept)
        return self._commit(
            req, result.tokens, num_draft=len(draft), num_accepted=result.num_accepted, features=kept, head=head,
        )

    def _decide(
        self,
        req: _Request,
        draft: torch.Tensor,
        draft_probs: torch.Tensor | None,
        head: torch.Tensor,
        allowed: torch.Tensor | None,
        *,
        first_position: int,
    ) -> Acceptance:
        """The accept rule over one request's rows (l = 0 at prefill: the first token). The target's logits go through
        the request's controls row by row; then greedy takes the argmax, a seeded sampled request Gumbel-max coupling
        with noise of the positions its rows predict (row j: ``first_position + j``; ``coupling.py``), an unseeded
        one rejection sampling."""
        if req.screened:
            return accept_greedy(draft, head)
        logits = req.controls.process(head, draft.tolist(), allowed) if req.controls is not None else head
        p = req.params
        if p.greedy:
            return accept_greedy(draft, logits.argmax(-1))
        if p.seed is not None:
            positions = list(range(first_position, first_position + len(draft) + 1))
            if req.noise is None:
                req.noise = NoiseRows(p.seed, self.vocab_size)
            noise = req.noise.rows(positions)
            if req.controls is None:
                return accept_coupled(draft, logits, noise, temperature=p.temperature, top_p=p.top_p)
            return accept_greedy(draft, (sampling_probs(logits, p).log() + noise).argmax(-1))
        if req.controls is None:
            probs = target_probs(logits, temperature=p.temperature, top_p=p.top_p)
        else:
            probs = sampling_probs(logits, p)
        return accept_sampled(draft, draft_probs.cpu() if draft_probs is not None else None, probs, req.generator)

    def _block_masks(self, req: _Request, draft: list[int], *,
                     through_forbidden: bool = False) -> tuple[int, torch.Tensor]:
        """``req.grammar.block_masks``; a grammar that fails (``GrammarError``) ends its request alone: the request's
        rows allow the end tokens only, no draft kept, and ``_commit`` finishes it with ``FinishReason.ERROR``."""
        try:
            return req.grammar.block_masks(draft, through_forbidden=through_forbidden)
        except GrammarError as err:
            self._fail_request(req, err)
            return 0, req.grammar.eos_only()[None]

    def _fail_request(self, req: _Request, err: Exception) -> None:
        if req.failed is None:
            req.failed = str(err)
            log.warning("request %s ends with an error: %s", req.request_id, err)

    def _commit(
        self, req: _Request, tokens: list[int], *, num_draft: int, num_accepted: int, features: torch.Tensor,
        head: torch.Tensor, cached_tokens: int = 0, prompt_logprobs: list[TokenLogprob | None] | None = None,
    ) -> StepOutput:
        """Append committed tokens one by one, ending the request exactly at EOS / stop token / stop string /
        max_tokens; advance the request's controls and grammar over them; their logprobs from ``head``'s raw
        logits when asked for. ``cached_tokens``: a prefill's prompt tokens reused from the prefix cache;
        ``prompt_logprobs``: a prefill's, passed on."""
        p = req.params
        kept: list[int] = []
        reason = stop_reason = None
        for tok in tokens:
            kept.append(tok)
            req.output_ids.append(tok)
            eos = tok in self.eos_token_ids and not p.ignore_eos
            if eos or tok in p.stop_token_ids:
                if p.include_stop_str_in_output:
                    req.detok.add(tok)
                else:  # its id is in the output, its text is not (vLLM's rule, as for a stop string)
                    req.detok.add_without_text(tok)
                reason, stop_reason = FinishReason.STOP, None if eos else tok  # vLLM looks for EOS first
                break
            req.detok.add(tok, check_stop=len(req.output_ids) >= p.min_tokens)
            if req.detok.stopped:
                reason, stop_reason = FinishReason.STOP, req.detok.stop_string
            elif len(req.output_ids) >= p.max_tokens:
                reason = FinishReason.LENGTH
            if reason is not None:
                break
        req.pending = kept[-1]
        if reason is None and req.grammar is not None and req.failed is None:
            try:
                req.grammar.commit(kept)
            except GrammarError as err:
                self._fail_request(req, err)
        if req.failed is not None:
            reason, stop_reason = FinishReason.ERROR, None
        finished = reason is not None
        if finished:
            self.release(req.request_id)
        elif req.controls is not None:
            req.controls.commit(kept)
        text, text_lens = req.detok.release(final=finished)
        return StepOutput(
            request_id=req.request_id,
            new_token_ids=kept,
            num_draft=num_draft,
            num_accepted=min(num_accepted, len(kept)),
            finished=finished,
            finish_reason=reason,
            text=text,
            text_lens=text_lens,
            features=features,
            logprobs=token_logprobs(head, kept, p.logprobs) if p.logprobs is not None else None,
            num_cached_tokens=cached_tokens,
            prompt_logprobs=prompt_logprobs,
            error=req.failed,
            stop_reason=stop_reason,
        )
