"""Speculative sampling keeps the target's distribution (toy Markov target), and top-p / seeds behave."""

from __future__ import annotations

import itertools

import pytest
import torch

from app.loop import generate
from app.engine.sampling import accept_sampled, target_probs
from app.engine.types import DraftBlock, SamplingParams
from tests.engine.proposers import RandomProposer

V = 4  # toy vocabulary
SEQ = 3  # tokens per sampled sequence; the joint over V**SEQ = 64 cells is tested


def _markov(seed: int) -> torch.Tensor:
    """[V, V] row-stochastic transition matrix: P(next | previous)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(V, V, generator=g) ** 2 + 0.02
    return m / m.sum(-1, keepdim=True)


def _sample_sequences(n: int, target: torch.Tensor, draft: torch.Tensor | None, block: int, seed: int):
    """Generate ``n`` sequences of SEQ tokens by speculative sampling with a toy Markov target and drafter."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros((V,) * SEQ)
    for _ in range(n):
        seq = [0]  # token 0 is the prompt
        while len(seq) < SEQ + 1:
            drafts, qs, prev = [], [], seq[-1]
            for _k in range(block):
                if draft is None:  # deterministic proposal: always the toy's most likely token
                    tok = int(target[prev].argmin())
                else:
                    q = draft[prev]
                    qs.append(q)
                    tok = int(torch.multinomial(q, 1, generator=gen))
                drafts.append(tok)
                prev = tok
            context = [seq[-1]] + drafts
            p = torch.stack([target[t] for t in context])  # [block + 1, V]
            q = torch.stack(qs) if qs else None
            acc = accept_sampled(torch.tensor(drafts), q, p, gen)
            seq.extend(acc.tokens)
        counts[tuple(seq[1 : SEQ + 1])] += 1
    return counts


def _expected(target: torch.Tensor) -> torch.Tensor:
    exp = torch.zeros((V,) * SEQ)
    for cell in itertools.product(range(V), repeat=SEQ):
        prob, prev = 1.0, 0
        for tok in cell:
            prob *= float(target[prev, tok])
            prev = tok
        exp[cell] = prob
    return exp


@pytest.mark.parametrize("draft_kind", ["sampled", "deterministic"])
def test_speculative_sampling_matches_target_joint(draft_kind):
    target = _markov(0)
    draft = _markov(1) if draft_kind == "sampled" else None
    n = 6000
    counts = _sample_sequences(n, target, draft, block=3, seed=2)
    exp = _expected(target) * n
    chi2 = float(((counts - exp) ** 2 / exp).sum())
    # 63 degrees of freedom: the 0.999 quantile of chi-square(63) is 103.4.
    assert chi2 < 103.4, f"chi-square {chi2:.1f}: output distribution differs from the target's"
    tv = 0.5 * float((counts / n - exp / n).abs().sum())
    assert tv < 0.05


def test_biased_acceptance_would_be_caught():
    """Control: the chi-square test above rejects a sampler that always accepts drafts."""
    target, draft = _markov(0), _markov(1)
    gen = torch.Generator().manual_seed(3)
    n, counts = 6000, torch.zeros((V,) * SEQ)
    for _ in range(n):
        seq = [0]
        for _k in range(SEQ):
            seq.append(int(torch.multinomial(draft[seq[-1]], 1, generator=gen)))
        counts[tuple(seq[1:])] += 1
    exp = _expected(target) * n
    assert float(((counts - exp) ** 2 / exp).sum()) > 103.4


def test_top_p_keeps_smallest_set_reaching_mass():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = target_probs(logits, temperature=1.0, top_p=0.7)
    assert torch.allclose(p, torch.tensor([[0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]]))
    assert torch.allclose(target_probs(logits, temperature=1.0, top_p=1.0), torch.softmax(logits, -1))


def test_sampled_engine_run_is_seed_reproducible_and_valid(engine, eval_prompts):
    prompt = engine.encode_chat([{"role": "user", "content": eval_prompts[0]}])
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=7)
    runs = []
    for _ in range(2):
        proposer = RandomProposer(engine.vocab_size, [4], seed=5)
        (res,), _ = generate(engine, [prompt], params, proposer=proposer)
        runs.append(res.token_ids)
    assert runs[0] == runs[1]
    assert 1 <= len(runs[0]) <= 24 and all(0 <= t < engine.vocab_size for t in runs[0])


def verify_unseeded(engine, monkeypatch, prompt, make_block, generator_seed: int):
    """One verify step of an unseeded sampled request (rejection sampling) whose generator starts from
    ``generator_seed``, of the block ``make_block(request_id, first output token)``: (accepted drafts, committed
    tokens)."""
    monkeypatch.setattr("app.engine.engine.secrets.randbits", lambda bits: generator_seed)
    first = engine.add_request("q", prompt, SamplingParams(max_tokens=8, temperature=1.0)).new_token_ids[0]
    (out,) = engine.verify([make_block("q", first)])
    if not out.finished:
        engine.release("q")
    return out.num_accepted, out.new_token_ids


def likely_tokens(engine, context: list[int], depth: int, top: int) -> torch.Tensor:
    """[depth, top] the target's ``top`` most likely tokens at each of the next ``depth`` positions after
    ``context``, along its greedy path (drafts it often accepts, so acceptance depends on q)."""
    from app.engine.near_tie import teacher_forced_logits

    path = list(context)
    rows = []
    for _ in range(depth):
        row = teacher_forced_logits(engine, path)[-1].topk(top).indices
        rows.append(row)
        path.append(int(row[0]))
    return torch.stack(rows)


def test_sparse_draft_probs_verify_as_their_dense_expansion(engine, monkeypatch):
    """A sparse block (prob_ids + probs) gives the same acceptance and tokens as its dense [K, V] expansion with the
    same generator, under rejection sampling (which reads q): the engine expands it exactly (q = 0 outside
    prob_ids)."""
    prompt = engine.encode("The capital of France is")
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.9, 0.05, 0.05], [0.2, 0.2, 0.6]])

    def block(dense: bool):
        def make(rid: str, first: int) -> DraftBlock:
            ids = likely_tokens(engine, prompt + [first], depth=3, top=3)
            sparse = DraftBlock(rid, ids[:, 0], probs, prob_ids=ids)
            expanded = torch.zeros(3, engine.vocab_size).scatter_(1, ids, probs)
            assert torch.equal(sparse.dense_probs(engine.vocab_size), expanded)
            return DraftBlock(rid, ids[:, 0], expanded) if dense else sparse
        return make

    outcomes = [verify_unseeded(engine, monkeypatch, prompt, block(dense=False), seed) for seed in range(8)]
    assert outcomes == [verify_unseeded(engine, monkeypatch, prompt, block(dense=True), seed) for seed in range(8)]
    assert len({n for n, _ in outcomes}) > 1  # acceptance varies with the generator: q is read


def test_sampled_verify_uses_draft_probs(engine, monkeypatch):
    """Rejection sampling reads the draft probabilities: a point-mass q verifies like no q (a deterministic
    proposal), and a q that puts half its mass elsewhere changes the outcome for some generator."""
    prompt = engine.encode("The capital of France is")

    def block(q: str):
        def make(rid: str, first: int) -> DraftBlock:
            ids = likely_tokens(engine, prompt + [first], depth=2, top=2)
            if q == "none":
                return DraftBlock(rid, ids[:, 0])
            mass = ids[:, :1] if q == "point" else ids
            return DraftBlock(rid, ids[:, 0], torch.zeros(2, engine.vocab_size).scatter_(1, mass, 1.0 / mass.shape[1]))
        return make

    same, differs = True, False
    for seed in range(8):
        plain = verify_unseeded(engine, monkeypatch, prompt, block("none"), seed)
        same &= verify_unseeded(engine, monkeypatch, prompt, block("point"), seed) == plain
        differs |= verify_unseeded(engine, monkeypatch, prompt, block("spread"), seed) != plain
    assert same and differs


def test_top_p_nucleus_beyond_the_candidates_is_sorted_whole():
    """A flat row's nucleus reaches past NUCLEUS_CANDIDATES tokens: the same set as a full sort keeps."""
    from app.engine.sampling import NUCLEUS_CANDIDATES

    v = 4 * NUCLEUS_CANDIDATES
    logits = torch.stack([torch.linspace(0.0, 1.0, v), torch.linspace(0.0, 30.0, v)])  # flat; peaked
    p = target_probs(logits, temperature=1.0, top_p=0.9)
    full = torch.softmax(logits, -1)
    for row in range(2):
        sorted_p, order = full[row].sort(descending=True)
        keep = order[(sorted_p.cumsum(-1) - sorted_p) < 0.9]
        assert set((p[row] > 0).nonzero().flatten().tolist()) == set(keep.tolist())
        assert torch.allclose(p[row].sum(), torch.tensor(1.0))
    assert int((p[0] > 0).sum()) > NUCLEUS_CANDIDATES > int((p[1] > 0).sum())


def test_sample_draws_from_the_distribution_and_never_a_zero_token():
    from app.engine.sampling import sample

    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([sample(probs, gen) for _ in range(6000)]), minlength=6).float()
    assert counts[[0, 2, 5]].sum() == 0
    exp = probs * 6000
    chi2 = float(((counts[[1, 3, 4]] - exp[[1, 3, 4]]) ** 2 / exp[[1, 3, 4]]).sum())
    assert chi2 < 13.8  # the 0.999 quantile of chi-square(2)
    assert sample(torch.tensor([0.0, 2.0, 0.0]), gen) == 1  # unnormalised mass is fine


def test_batched_rejection_sampling_decides_as_the_per_request_rule():
    """``accept_sampled_batch`` draws the same uniforms in the same order as ``accept_sampled``: on the same
    distributions and generators, the same accepted counts and tokens, request by request. Cases mix empty blocks,
    point-mass and dense proposals, top-p-truncated targets and a proposal equal to the target (empty residual)."""
    from app.engine.sampling import accept_sampled_batch

    vocab, gen = 50, torch.Generator().manual_seed(0)
    checked = accepted = 0
    for _ in range(200):
        lengths = torch.randint(0, 5, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist()
        probs = target_probs(2 * torch.randn(sum(lengths) + len(lengths), vocab, generator=gen), temperature=0.8,
                             top_p=0.9)
        drafts = [torch.randint(vocab, (n,), generator=gen) for n in lengths]
        proposals, first = [], 0
        for n, kind in zip(lengths, torch.randint(3, (len(lengths),), generator=gen).tolist()):
            if kind == 0:
                proposals.append(None)
            elif kind == 1:
                proposals.append(torch.softmax(torch.randn(n, vocab, generator=gen), -1))
            else:  # q = p: every draft drawn where the target has mass, and a rejection leaves no residual
                proposals.append(probs[first : first + n].clone())
            first += n + 1
        seeds = torch.randint(1 << 30, (len(lengths),), generator=gen).tolist()
        batch = accept_sampled_batch(drafts, proposals, probs, [torch.Generator().manual_seed(s) for s in seeds])
        first = 0
        for n, d, q, s, got in zip(lengths, drafts, proposals, seeds, batch):
            assert got == accept_sampled(d, q, probs[first : first + n + 1], torch.Generator().manual_seed(s))
            first += n + 1
            checked, accepted = checked + 1, accepted + got.num_accepted
    assert checked > 500 and accepted > 0


def test_plain_sampled_requests_are_verified_in_one_batch_and_keep_the_distribution(engine32, monkeypatch):
    """Unseeded sampled requests without controls go through ``accept_sampled_batch`` together (several requests a
    call; on an accelerator by default, here turned on for the CPU); the three-token joint under speculation passes
    the chi-square test (temperature 0.7, top_p 0.8)."""
    import app.engine.engine as engine_module
    from tests.engine.chi2 import check_three_token_joint_under_speculation

    batched = engine_module.accept_sampled_batch
    sizes = []

    def counting(drafts, *args):
        sizes.append(len(drafts))
        return batched(drafts, *args)

    monkeypatch.setattr(engine_module, "accept_sampled_batch", counting)
    monkeypatch.setattr(engine32, "_batch_sampling", True)
    params = SamplingParams(max_tokens=3, temperature=0.7, top_p=0.8, ignore_eos=True)
    check_three_token_joint_under_speculation(engine32, engine32.encode("la la la la la la la"), params, n=480)
    assert sizes and max(sizes) > 1
