"""The sampling controls applied inside verification: per-request, per-position processing of the target's logits.

Owns: the state the controls need (output token counts, the prompt's tokens, the committed length) and, for a
verify step over ``[pending, d_1 .. d_l]``, the processed logits of every row with the state the request *would*
have if drafts ``d_1 .. d_i`` were committed (row i predicts output token ``num_output + i``); the sampling
distribution (temperature, top-k, min-p, top-p); the logprobs returned to the client. Pure tensor functions and
one small state object per request; no model. Does not own: grammar masks (``app/engine/grammar.py``, passed in as
``allowed``) or the accept rules (``app/engine/sampling.py``), which receive the processed target distribution, so
acceptance stays lossless against it.

Order at each row (the earlier steps change logits, the last three only truncate):

1. ``allowed_token_ids``: every token outside the set gets logit -inf (vLLM applies it before its other
   processors); ``bad_words``: a word's last token gets -inf at a row whose output so far (drafts 1..i included)
   ends with the word's other tokens, a one-token word at every row (vLLM's rule, over the output only);
   ``logit_bias``: added to the logits (OpenAI). They act at every row, so a draft they exclude has target
   probability 0 and is rejected, and a greedy row takes the argmax of what is left.
2. ``min_tokens``: while ``num_output + i < min_tokens``, EOS (unless ``ignore_eos``) and ``stop_token_ids`` get
   logit -inf (vLLM's definition).
3. ``repetition_penalty`` r on every token in the prompt or the output so far (drafts 1..i included): a logit z
   becomes z / r if z > 0, else z * r (CTRL, Keskar et al. 2019, as in vLLM and transformers).
4. ``frequency_penalty`` f and ``presence_penalty`` p: z -= f * count + p * [count > 0], count = occurrences in the
   output so far, drafts 1..i included (OpenAI's formula; the prompt does not count).
5. The grammar mask: tokens the grammar forbids get -inf.
6. Sampled requests only: temperature T (z / T), then ``top_k`` (tokens below the k-th largest value are dropped;
   ties with it are kept), then ``min_p`` (tokens with probability below min_p times the largest are dropped),
   then ``top_p`` over what remains (``app/engine/sampling.target_probs``). Greedy requests take the argmax of
   step 5's logits (steps 6's truncations all keep the argmax).

Logprobs (``SamplingParams.logprobs``) are the *raw* target's: log_softmax of the model's logits before any of the
steps above (temperature 1, no penalty, bias or mask), as vLLM returns by default: the alternatives may hold tokens
``allowed_token_ids`` or the grammar leave out. They depend only on the target and the committed tokens, so they are
the same with speculation on and off.

Shape symbols: n rows of one request's verify step (n = l + 1; n = 1 at prefill), l drafts, V vocabulary,
C committed tokens.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from app.engine.sampling import target_probs
from app.engine.types import SamplingParams, TokenLogprob


class RequestControls:
    """One request's control state (module docstring); ``commit`` advances it on committed tokens only.

    Args:
        params: the request's settings.
        prompt_ids: the prompt (the repetition penalty counts its tokens as seen).
        eos_token_ids: the engine's end tokens (masked with ``stop_token_ids`` under ``min_tokens``).
        vocab_size: V.
        bad_words_ids: the token ids of ``params.bad_words`` (``TargetEngine.bad_words_ids``), each a sequence of one
            or more ids.

    The caller has checked that every ``logit_bias``, ``stop_token_ids`` and ``allowed_token_ids`` id lies in [0, V),
    and that ``min_tokens`` leaves an allowed token (a row with every logit -inf has no distribution).
    """

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int], *, eos_token_ids: Sequence[int],
                 vocab_size: int, bad_words_ids: Sequence[Sequence[int]] = ()) -> None:
        self.params = params
        self.vocab_size = vocab_size
        self.num_output = 0
        self.counts = torch.zeros(vocab_size)  # [V] float32 occurrences of each token in the committed output
        self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool)  # [V] tokens of the prompt
        self.in_prompt[torch.as_tensor(list(prompt_ids), dtype=torch.long)] = True
        self.bias = torch.zeros(vocab_size)  # [V] float32 logit_bias, dense; -inf outside allowed_token_ids
        for tok, b in params.logit_bias:
            self.bias[tok] = b
        if params.allowed_token_ids is not None:
            outside = torch.ones(vocab_size, dtype=torch.bool)  # [V]
            outside[list(params.allowed_token_ids)] = False
            self.bias[outside] = -math.inf
        for word in bad_words_ids:
            if len(word) == 1:  # banned everywhere
                self.bias[word[0]] = -math.inf
        self.bad_sequences = [tuple(w) for w in bad_words_ids if len(w) > 1]  # banned after their other tokens
        longest = max((len(w) for w in self.bad_sequences), default=1)
        self.recent: list[int] = []  # the last ``longest - 1`` committed output tokens (the bad words' context)
        self._context = longest - 1
        ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.end_ids = torch.tensor(sorted(ends), dtype=torch.long)  # masked while under min_tokens

    def commit(self, tokens: Sequence[int]) -> None:
        """Count committed output tokens."""
        for tok in tokens:
            self.counts[tok] += 1
        self.num_output += len(tokens)
        if self._context:
            self.recent = (self.recent + list(tokens))[-self._context :]

    def _bad_word_rows(self, draft: Sequence[int], n: int) -> list[tuple[int, int]]:
        """(row, token) pairs that ``bad_words`` ban: row i's output so far is the committed output + drafts 1..i."""
        banned = []
        for i in range(n):
            output = self.recent + list(draft[:i])
            for word in self.bad_sequences:
                if len(output) >= len(word) - 1 and tuple(output[len(output) - len(word) + 1 :]) == word[:-1]:
                    banned.append((i, word[-1]))
        return banned

    def process(self, logits: torch.Tensor, draft: Sequence[int], allowed: torch.Tensor | None) -> torch.Tensor:
        """Steps 1-5 of the module docstring at every row of a verify step.

        Args:
            logits: [n, V] the target's logits, row i after the committed output + drafts 1..i.
            draft: the n - 1 draft tokens.
            allowed: [n, V] bool grammar masks (``RequestGrammar.block_masks``), or None.

        Returns:
            [n, V] float32 processed logits (a new tensor).
        """
        p = self.params
        n = logits.shape[0]
        if len(draft) != n - 1:
            raise ValueError(f"{len(draft)} drafts for {n} rows of logits")
        out = logits.float() + self.bias
        for row, tok in self._bad_word_rows(draft, n) if self.bad_sequences else ():
            out[row, tok] = -math.inf
        if p.min_tokens and self.end_ids.numel():
            under = torch.arange(n) + self.num_output < p.min_tokens  # [n] bool
            out[under.nonzero().flatten().unsqueeze(1), self.end_ids] = -math.inf
        if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
            counts = self.counts.expand(n, -1).clone()  # [n, V] output counts as of each row
            for j, tok in enumerate(draft):
                counts[j + 1 :, tok] += 1
            if p.repetition_penalty != 1.0:
                seen = self.in_prompt | (counts > 0)
                penalised = torch.where(out > 0, out / p.repetition_penalty, out * p.repetition_penalty)
                out = torch.where(seen, penalised, out)
            out = out - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
        if allowed is not None:
            out = out.masked_fill(~allowed, -math.inf)
        return out


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Step 6 of the module docstring: processed logits [n, V] -> sampling distributions [n, V] float32.

    Raises:
        ValueError: ``params`` is greedy (temperature 0: take the argmax of the logits instead).
    """
    if params.greedy:
        raise ValueError("sampling_probs needs temperature > 0; greedy requests take the argmax")
    scaled = logits.float() / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = scaled.topk(params.top_k, dim=-1).values[:, -1:]  # [n, 1]
        scaled = scaled.masked_fill(scaled < kth, -math.inf)
    if params.min_p > 0.0:  # p_j < min_p * p_max  <=>  z_j - z_max < log(min_p)
        best = scaled.max(dim=-1, keepdim=True).values
        scaled = scaled.masked_fill(scaled - best < math.log(params.min_p), -math.inf)
    return target_probs(scaled, temperature=1.0, top_p=params.top_p)


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], k: int, *, ranks: bool = False) -> list[TokenLogprob]:
    """The raw target's log-probabilities (module docstring) of committed tokens and their top-k alternatives.

    Args:
        logits: [C, V] the target's raw logits, row c the distribution ``tokens[c]`` was chosen from.
        tokens: the C committed tokens.
        k: alternatives per token (``SamplingParams.logprobs``, 0..20).
        ranks: also each token's rank in its row (``TokenLogprob.rank``: 1 + the tokens of higher logprob).

    Returns:
        One ``TokenLogprob`` per token, alternatives most likely first (natural log).
    """
    logp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)  # [C, V]
    chosen = logp[torch.arange(len(tokens)), torch.as_tensor(list(tokens), dtype=torch.long)]  # [C]
    rank = ((logp > chosen[:, None]).sum(-1) + 1).tolist() if ranks else [None] * len(tokens)
    if k:
        values, ids = logp.topk(k, dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(token_id=t, logprob=c, top=top, rank=r)
            for t, c, top, r in zip(tokens, chosen.tolist(), tops, rank)]
