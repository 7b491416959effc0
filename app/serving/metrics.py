"""Prometheus metrics of the Serve application, through Ray's metrics API (``ray.util.metrics``).

Owns: the metric definitions (names prefixed ``dspark_``, descriptions, tags, histogram buckets) and one
recorder class per deployment: ``TargetMetrics``, ``DrafterMetrics``, ``RouterMetrics``. Every metric carries
the tags ``policy`` (the verify-length policy) and ``replica`` (the reporting replica; for the Router's
figures, the target replica they describe). Ray exports them from each node's metrics agent with a ``ray_``
prefix (counters also get ``_total``), e.g. ``ray_dspark_accepted_tokens_total``; the full table is in
``docs/observability.md``.

Words (as in ``app/engine/types.py``): *drafted* tokens came out of the drafter; *verified* tokens are the
drafted tokens the scheduler sent to the target (the verify length l); *accepted* tokens are verified tokens
the target kept; *wasted* = verified - accepted. *Accepted length* tau is committed tokens per round
(accepted + the bonus / recovered token).

Does not own: when anything is recorded (the deployments call the recorders) or TPOT windows
(``app/serving/telemetry.py``). Ray's histogram sums are approximations (bucket midpoints), so exact totals
are counters and histograms serve distributions and quantiles.
"""

from __future__ import annotations

import math

from prometheus_client.utils import floatToGoString
from ray.util.metrics import Counter, Gauge, Histogram

from app.serving.protocol import FALLBACK_CAUSES

TAGS = ("policy", "replica")
FALLBACKS_HELP = ("Requests moved to plain decoding for the rest of their life, by cause "
                  f"({', '.join(FALLBACK_CAUSES)}).")
# Step, call and per-token times (ms), 1-1.5-2-3-4-5-7.5 per decade: a quantile read from the buckets (Grafana's
# histogram_quantile interpolates inside one) is within 1.5x of the truth from a GPU step to a slow CPU batch.
MS_BUCKETS = [1, 1.5, 2, 3, 4, 5, 7.5, 10, 15, 20, 30, 40, 50, 75, 100, 150, 200, 300, 400, 500, 750, 1000, 1500, 2000,
              3000, 4000, 5000, 7500, 10000]
TPOT_BUCKETS = [b for b in MS_BUCKETS if 2 <= b <= 3000]
TOKENS_PER_STEP_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def accepted_length_buckets(gamma: int) -> list[float]:
    """Bucket edges for tau in [1, gamma + 1], every half token."""
    return [1 + 0.5 * i for i in range(2 * gamma + 1)]


class TargetMetrics:
    """What a target replica records (per round, per finished request, per report interval)."""

    def __init__(self, *, policy: str, replica: str, gamma: int) -> None:
        tags = {"policy": policy, "replica": replica}

        def counter(name: str, description: str, keys: tuple[str, ...] = TAGS) -> Counter:
            return Counter(name, description, tag_keys=keys).set_default_tags(tags)

        def gauge(name: str, description: str, keys: tuple[str, ...] = TAGS) -> Gauge:
            return Gauge(name, description, tag_keys=keys).set_default_tags(tags)

        def histogram(name: str, description: str, buckets: list[float]) -> Histogram:
            return Histogram(name, description, boundaries=buckets, tag_keys=TAGS).set_default_tags(tags)

        self.gamma = gamma
        self.drafted = counter("dspark_drafted_tokens", "Draft tokens offered for verification: per request, the "
                               "drafter's block or the prompt-lookup draft chosen (before the verify-length cut).")
        self.verified = counter("dspark_verified_tokens", "Draft tokens sent to the target for verification.")
        self.accepted = counter("dspark_accepted_tokens", "Verified draft tokens the target accepted.")
        self.wasted = counter("dspark_wasted_tokens", "Verified draft tokens the target rejected.")
        self.output = counter("dspark_output_tokens", "Tokens streamed to clients (prefill first tokens included).")
        self.rounds = counter("dspark_rounds", "Rounds (one verify step over the batch).")
        self.drafted_rounds = counter(
            "dspark_drafted_rounds", "Rounds that called the drafter (the others: draft gate closed, or no request "
            "on the drafter).")
        self.guard_plain_rounds = counter(
            "dspark_guard_plain_rounds", "Rounds the speculation guard ran plain although requests speculate: where "
            "plain rounds measured faster, and its probes (app/scheduling/guard.py).")
        self.lookup_drafts = counter(
            "dspark_lookup_drafts", "Request-rounds that verified a prompt-lookup draft instead of the drafter's "
            "block (or in a round without a drafter call).")
        self.requests = counter("dspark_requests_finished", "Requests that finished (EOS, stop or length).")
        self.requests_cancelled = counter("dspark_requests_cancelled", "Requests whose client went away before they "
                                          "finished (their KV slot and queue place freed).")
        self.prefix_queries = counter("dspark_prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                                      "(every admitted prompt token).")
        self.prefix_hits = counter("dspark_prefix_cache_hits", "Prompt tokens found in the prefix cache (not "
                                   "prefilled).")
        self.fallbacks = counter("dspark_fallbacks", FALLBACKS_HELP, TAGS + ("cause",))
        self.position_verified = counter(
            "dspark_position_verified", "Draft tokens verified at block position k (1-based).", TAGS + ("position",))
        self.position_accepted = counter(
            "dspark_position_accepted", "Draft tokens accepted at block position k (1-based).", TAGS + ("position",))
        self.accepted_length = histogram(
            "dspark_accepted_length", "Per finished request: committed tokens per round (tau).",
            accepted_length_buckets(gamma))
        self.verify_ms = histogram("dspark_verify_step_ms", "Target verify step time (ms).", MS_BUCKETS)
        self.verify_cpu_ms = counter(
            "dspark_verify_cpu_ms", "Time the engine thread ran on a CPU during verify steps (ms; Linux).")
        self.verify_cpu_wait_ms = counter(
            "dspark_verify_cpu_wait_ms", "Time the engine thread was ready to run but waited for a CPU during verify "
            "steps (ms; Linux): what other processes on the replica's cores cost its steps.")
        self.round_ms = histogram("dspark_round_ms", "Whole round time: drafter call + schedule + verify (ms).",
                                  MS_BUCKETS)
        self.tokens_per_step = histogram(
            "dspark_tokens_per_step", "Tokens committed per round over the whole batch.", TOKENS_PER_STEP_BUCKETS)
        self.ttft = histogram("dspark_ttft_ms", "Per request: time from its arrival at the target replica to its first "
                              "token (ms): tokenizing, waiting for a KV slot, prefill.", MS_BUCKETS)
        self.tpot = histogram("dspark_tpot_ms", "Per finished request: time per output token after the first (ms).",
                              TPOT_BUCKETS)
        self.active = gauge("dspark_active_requests", "Requests decoding on the replica.")
        self.queued = gauge("dspark_queued_requests", "Requests waiting for a KV slot on the replica.")
        self.capacity = gauge("dspark_verify_capacity", "Verification slots the scheduler chose in the last round "
                              "(sum of verify lengths over the batch).")
        self.tpot_window = gauge("dspark_tpot_window_ms", "TPOT quantile over the SLO window (ms), as the "
                                 "autoscaler sees it.", TAGS + ("quantile",))
        self.slo_limit = gauge("dspark_slo_tpot_limit_ms", "TPOT limit of the SLO (ms).")
        self.slo_state = gauge("dspark_slo_state", "SLO on this replica: 1 met, 0 violated, -1 no samples.")

    def round(self, *, round_ms: float, verify_ms: float, drafter_called: bool, drafted: int, lookup: int,
              num_draft: list[int], num_accepted: list[int], committed: int,
              verify_cpu: tuple[float, float] | None, guarded: bool) -> None:
        """One round: ``num_draft`` / ``num_accepted`` per request in the batch (verified / accepted), ``lookup``
        requests of them verifying a prompt-lookup draft, ``verify_cpu`` the engine thread's (ms on a CPU, ms waiting
        for one) during the verify step (None: not measured), ``guarded`` whether the speculation guard ran it plain."""
        self.rounds.inc()
        if drafter_called:
            self.drafted_rounds.inc()
        if guarded:
            self.guard_plain_rounds.inc()
        if lookup:
            self.lookup_drafts.inc(lookup)
        self.round_ms.observe(round_ms)
        self.verify_ms.observe(verify_ms)
        if verify_cpu is not None:
            on_cpu, waiting = verify_cpu
            if on_cpu > 0:
                self.verify_cpu_ms.inc(on_cpu)
            if waiting > 0:
                self.verify_cpu_wait_ms.inc(waiting)
        self.tokens_per_step.observe(committed)
        verified, accepted = sum(num_draft), sum(num_accepted)
        self.capacity.set(verified)
        for value, metric in ((drafted, self.drafted), (verified, self.verified), (accepted, self.accepted),
                              (verified - accepted, self.wasted)):
            if value:
                metric.inc(value)
        for k in range(1, max(num_draft, default=0) + 1):
            n_verified = sum(1 for n in num_draft if n >= k)
            n_accepted = sum(1 for n in num_accepted if n >= k)
            self.position_verified.inc(n_verified, tags={"position": str(k)})
            if n_accepted:
                self.position_accepted.inc(n_accepted, tags={"position": str(k)})

    def fallback(self, cause: str, n: int) -> None:
        """``n`` requests fell back to plain decoding for ``cause``."""
        if n:
            self.fallbacks.inc(n, tags={"cause": cause})

    def prefilled(self, *, prompt_tokens: int, cached_tokens: int, ttft_ms: float) -> None:
        """A request was admitted: ``prompt_tokens`` looked up in the prefix cache, ``cached_tokens`` found, its first
        token ``ttft_ms`` after it arrived."""
        self.ttft.observe(ttft_ms)
        self.prefix_queries.inc(prompt_tokens)
        if cached_tokens:
            self.prefix_hits.inc(cached_tokens)

    def tokens(self, n: int) -> None:
        if n:
            self.output.inc(n)

    def finished(self, *, accepted_length: float | None, tpot_ms: float | None) -> None:
        """A request finished; ``accepted_length`` None when it never ran a speculative round."""
        self.requests.inc()
        if accepted_length is not None:
            self.accepted_length.observe(accepted_length)
        if tpot_ms is not None:
            self.tpot.observe(tpot_ms)

    def load(self, *, active: int, queued: int) -> None:
        self.active.set(active)
        self.queued.set(queued)

    def slo(self, *, limit_ms: float, quantiles: dict[int, float] | None, met: bool | None) -> None:
        """SLO figures; ``quantiles`` (percentile -> ms) and ``met`` are None without samples."""
        self.slo_limit.set(limit_ms)
        self.slo_state.set(-1 if met is None else int(met))
        for q, value in (quantiles or {}).items():
            self.tpot_window.set(value, tags={"quantile": str(q)})


class DrafterMetrics:
    """What a drafter replica records per call."""

    def __init__(self, *, policy: str, replica: str) -> None:
        tags = {"policy": policy, "replica": replica}
        self.call_ms = Histogram("dspark_draft_call_ms", "Drafter call time on the drafter replica (ms): hooks "
                                 "+ drafting the batch.", boundaries=MS_BUCKETS, tag_keys=TAGS).set_default_tags(tags)
        self.batch = Histogram("dspark_draft_batch_size", "Requests drafted per call.",
                               boundaries=TOKENS_PER_STEP_BUCKETS, tag_keys=TAGS).set_default_tags(tags)

    def call(self, *, ms: float, batch: int) -> None:
        self.call_ms.observe(ms)
        self.batch.observe(batch)


ROUTER_FIGURES = {  # TargetLoad field (or snapshot key) -> (metric name, description)
    "active": ("dspark_router_active_requests", "Requests decoding on the target replica (its last report)."),
    "waiting": ("dspark_router_queued_requests", "Requests queued on the target replica (its last report)."),
    "step_ms": ("dspark_router_step_ms", "EMA of the target replica's round time (ms)."),
    "tokens_per_step": ("dspark_router_tokens_per_step", "EMA of tokens committed per round on the replica."),
    "acceptance": ("dspark_router_acceptance", "EMA of accepted / verified draft tokens on the replica."),
    "drafter_failures": ("dspark_router_drafter_failures", "Requests failed over to plain decoding since start."),
    "verify_capacity": ("dspark_router_verify_capacity",
                        "Load-aware verification capacity the Router computes for the replica (slots per round)."),
}


class RouterMetrics:
    """The Router's per-target-replica figures (its snapshot), one gauge each, tagged with the target replica."""

    def __init__(self, *, policy: str) -> None:
        self.policy = policy
        self.gauges = {key: Gauge(name, description, tag_keys=TAGS) for key, (name, description)
                       in ROUTER_FIGURES.items()}
        self.live = Gauge("dspark_router_live_replicas", "Target replicas reporting to the Router.",
                          tag_keys=("policy",)).set_default_tags({"policy": policy})

    def snapshot(self, snapshot: dict) -> None:
        """Set every gauge from ``Router.snapshot()`` (per live target replica, and the live count)."""
        for replica_id, figures in snapshot["replicas"].items():
            tags = {"policy": self.policy, "replica": replica_id}
            for key, gauge in self.gauges.items():
                gauge.set(float(figures[key]), tags=tags)
        self.live.set(len(snapshot["replicas"]))


# GET /metrics on the API port: (counter name, description, SpecCounters field); each ``dspark_`` counter is also
# exported under vLLM's name, so vLLM's benchmark client and dashboards read this server unchanged.
API_COUNTERS = (
    ("dspark_spec_decode_drafts", "vllm:spec_decode_num_drafts",
     "Drafts verified: one request's block in one round.", "drafts"),
    ("dspark_spec_decode_draft_tokens", "vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", "draft_tokens"),
    ("dspark_spec_decode_accepted_tokens", "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
     "accepted_tokens"),
    ("dspark_rounds", None, "Rounds (one verify step over a replica's batch).", "rounds"),
    ("dspark_round_requests", None, "Requests in each round, summed over rounds (/ rounds: the mean batch).",
     "round_requests"),
    ("dspark_round_seconds", None, "Time in rounds: drafter call, scheduling, verify step, streaming (s).",
     "round_seconds"),
    ("dspark_verify_seconds", None, "Time in verify steps (s; part of dspark_round_seconds).", "verify_seconds"),
    ("dspark_drafter_wait_seconds", None, "Time rounds waited for the drafter's answer (s; part of "
     "dspark_round_seconds).", "drafter_wait_seconds"),
    ("dspark_verify_cpu_wait_seconds", None, "Time the engine thread was ready to run but waited for a CPU during "
     "verify steps (s; part of dspark_verify_seconds; Linux, else 0).", "verify_cpu_wait_seconds"),
    ("dspark_output_tokens", "vllm:generation_tokens", "Tokens streamed to clients.", "output_tokens"),
    (None, "vllm:prompt_tokens", "Prompt tokens admitted (prefilled or found in the prefix cache).",
     "prefix_cache_queries"),
    ("dspark_requests_finished", None, "Requests that finished (EOS, stop or length).", "requests_finished"),
    ("dspark_requests_cancelled", None, "Requests whose client went away before they finished.",
     "requests_cancelled"),
    ("dspark_guard_plain_rounds", None, "Rounds the speculation guard ran plain although requests speculate.",
     "guard_plain_rounds"),
    ("dspark_prefix_cache_queries", "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache (every "
     "admitted prompt token).", "prefix_cache_queries"),
    ("dspark_prefix_cache_hits", "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache (not prefilled).",
     "prefix_cache_hits"),
)
# GET /metrics on the API port: per-request histograms under vLLM's names (vLLM's bucket edges: ``protocol.py``).
API_HISTOGRAMS = (
    ("vllm:request_queue_time_seconds", "Time from arrival at a target replica to a KV slot (s).", "queue_s"),
    ("vllm:time_to_first_token_seconds", "Time from arrival at a target replica to the first token (s).", "ttft_s"),
    ("vllm:inter_token_latency_seconds", "Time between a request's token emissions (one per round that commits "
     "tokens: with speculation, several tokens at once) (s).", "itl_s"),
    ("vllm:e2e_request_latency_seconds", "Time from arrival at a target replica to the last token of a finished "
     "request (s).", "e2e_s"),
    ("vllm:request_prompt_tokens", "Prompt tokens of each admitted request.", "prompt_len"),
    ("vllm:request_generation_tokens", "Output tokens of each finished request.", "output_len"),
)
PER_POSITION = ("dspark_spec_decode_accepted_tokens_per_pos", "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted at block position (0-based).")


def prometheus_text(counters, *, model_name: str, positions: int, running: int, waiting: int) -> str:
    """``counters`` (the target replicas' summed ``SpecCounters``) and the requests ``running`` (holding a KV slot)
    and ``waiting`` (queued for one) on them, in Prometheus' text format (version 0.0.4), every sample labelled
    ``model_name`` as vLLM labels its own; block positions 0 .. ``positions`` - 1 (gamma), every fallback cause of
    ``FALLBACK_CAUSES`` and every histogram bucket are always present (a zero is a reading, not a missing series)."""
    label = 'model_name="' + model_name.replace("\\", "\\\\").replace('"', '\\"') + '"'
    lines = []
    for name, description, value in (
            ("vllm:num_requests_running", "Requests holding a KV slot (decoding or being prefilled).", running),
            ("vllm:num_requests_waiting", "Requests queued for a KV slot.", waiting)):
        lines.extend([f"# HELP {name} {description}", f"# TYPE {name} gauge", f"{name}{{{label}}} {value}"])

    def counter(name: str, description: str, samples: list[tuple[str, int]]) -> None:
        lines.extend([f"# HELP {name}_total {description}", f"# TYPE {name}_total counter"])
        lines.extend(f"{name}_total{{{labels}}} {value}" for labels, value in samples)

    for ours, vllm, description, attr in API_COUNTERS:
        for name in (ours, vllm):
            if name is not None:
                counter(name, description, [(label, getattr(counters, attr))])
    accepted = counters.accepted_per_pos + [0] * (positions - len(counters.accepted_per_pos))
    per_pos = [(f'{label},position="{k}"', n) for k, n in enumerate(accepted)]
    for name in PER_POSITION[:2]:
        counter(name, PER_POSITION[2], per_pos)
    counter("vllm:request_success", "Requests ended, by finish reason (abort: the client went away).",
            [(f'{label},finished_reason="{reason}"', n) for reason, n in (
                ("stop", counters.requests_finished - counters.requests_length), ("length", counters.requests_length),
                ("abort", counters.requests_cancelled))])
    for name, description, attr in API_HISTOGRAMS:
        hist = getattr(counters, attr)
        lines.extend([f"# HELP {name} {description}", f"# TYPE {name} histogram"])
        cumulative = 0
        for edge, n in zip((*hist.bounds, math.inf), hist.counts):  # ``le`` written as Prometheus' client does
            cumulative += n
            lines.append(f'{name}_bucket{{{label},le="{floatToGoString(edge)}"}} {cumulative}')
        lines.extend([f"{name}_sum{{{label}}} {hist.total!r}", f"{name}_count{{{label}}} {cumulative}"])
    causes = list(FALLBACK_CAUSES) + sorted(set(counters.fallbacks) - set(FALLBACK_CAUSES))
    counter("dspark_fallbacks", FALLBACKS_HELP,
            [(f'{label},cause="{cause}"', counters.fallbacks.get(cause, 0)) for cause in causes])
    return "\n".join(lines) + "\n"
