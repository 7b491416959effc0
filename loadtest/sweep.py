"""Concurrency sweep: headless Locust at a fixed user count per level, one server start per verify policy.

    python -m loadtest.sweep --concurrency 1,2,4,8,16 --duration 60 --policies none,mtp1,dspark
    python -m loadtest.sweep --url http://127.0.0.1:8100 --model smollm2-135m --policies vllm-cpu ...

Without ``--url`` each policy gets its own server: ``deployments/dspark.yaml`` (``--config``) with
``policy`` overridden (and any ``--set KEY=VALUE``), started in a child process on a free port
(``loadtest.server``), warmed up, swept over every level, then stopped. With ``--url`` the sweep loads any
OpenAI-compatible server and the policy names are only labels. Locust runs as a subprocess per level, so
its gevent monkey-patching never enters a process holding Ray or torch.

Per level: ramp to N users at once, ``--warmup`` seconds not measured, ``--duration`` seconds measured, then
every request in flight finishes (``--drain-timeout``). Writes under ``--out``: ``results.json``,
``results.csv``, ``levels/<policy>-c<N>.json``, ``pareto.png``, the raw per-request records
(``records/``), Locust's CSVs (``locust/``) and the server logs; prints a table, then one JSON line.
Metric definitions: ``loadtest/metrics.py`` and ``docs/loadtest.md``; where the server counts its rounds on
``/metrics`` (this one does), each level also gets its mean batch and mean round, verify-step, drafter-wait and
CPU-wait times over the whole level, warm-up and drain included (``loadtest/rounds.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable

import httpx
from tqdm import tqdm

from app.argtypes import base_url, int_list, name_list, non_negative_float, port_number, positive_float, positive_int
from loadtest.metrics import Slo, measurement_window, read_records, summarize
from loadtest.prompts import DEFAULT_PROMPTS, level_offsets, load_prompt_spec
from loadtest.report import format_table, level_name, pareto_plot, write_level, write_results
from loadtest.rounds import round_split, settled_counters
from loadtest.server import DEFAULT_CONFIG, REPO_ROOT, ManagedServer, check_server_flags, wait_ready

LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
LOCUST_GRACE_S = 60  # beyond run time + drain before a Locust process is considered hung
RUN_FILES = ("results.json", "results.csv", "pareto.png", "levels", "records", "locust", "server-*.log")


def optional_ms(text: str) -> float | None:
    return None if text.lower() in ("", "none", "off") else float(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int_list, default=[1, 2, 4, 8, 16], help="users per level")
    ap.add_argument("--duration", type=positive_float, default=60.0, help="measured seconds per level")
    ap.add_argument("--warmup", type=non_negative_float, default=5.0,
                    help="unmeasured seconds at the start of each level")
    ap.add_argument("--drain-timeout", type=positive_float, default=300.0,
                    help="seconds requests in flight may take to finish after a level")
    ap.add_argument("--policies", type=name_list, default=None,
                    help="verify policies, default none,mtp1,dspark; with --url only labels (default: one, 'server')")
    ap.add_argument("--url", type=base_url, default=None,
                    help="an external OpenAI-compatible server, http://HOST:PORT (a trailing /v1 is dropped; no "
                    "server is started)")
    ap.add_argument("--model", default=None, help="served model name (default: the config's served_model_name for a "
                    "started server; with --url the first model the server lists)")
    ap.add_argument("--config", type=Path, default=None,
                    help=f"Serve config YAML to start per policy (default: {DEFAULT_CONFIG.relative_to(REPO_ROOT)})")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override an application args field for every policy (repeatable)")
    ap.add_argument("--num-cpus", type=positive_float, default=None, help="CPUs of each local Ray (default: all)")
    ap.add_argument("--port", type=port_number, default=None,
                    help="HTTP port of the started servers (default: free)")
    ap.add_argument("--server-timeout", type=positive_float, default=600.0,
                    help="seconds a server may take to be ready")
    ap.add_argument("--server-warmup", type=int, default=2, help="short requests sent to each server before "
                    "its first level (not measured)")
    ap.add_argument("--prompts", default=DEFAULT_PROMPTS, help="evaluation set names or JSONL paths")
    ap.add_argument("--prompt-seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=positive_int, default=128)
    ap.add_argument("--max-tokens-range-ratio", type=float, default=0.0,
                    help="each request's max_tokens uniform in --max-tokens x [1 - r, 1 + r], the same sequence for "
                         "every policy (0: all the same; answers of one length make closed-loop users arrive in "
                         "cohorts)")
    ap.add_argument("--temperature", type=non_negative_float, default=0.0)
    ap.add_argument("--system-prompt-file", type=Path, default=None,
                    help="a text file sent as the system message of every request (a shared prompt prefix: the "
                    "level reports the server's prefix_cache_hit_rate from usage.prompt_tokens_details)")
    ap.add_argument("--multi-turn", action="store_true",
                    help="play each prompt line as a conversation: every turn in order, each after the answers to the "
                    "earlier ones (mt-bench: two turns); the level reports the later turns' TTFT apart")
    ap.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    ap.add_argument("--no-spec-stats", action="store_true", help="do not ask for the spec_stats extension")
    ap.add_argument("--api-key", default=os.environ.get("DSPARK_API_KEY", ""), help="default $DSPARK_API_KEY")
    ap.add_argument("--slo-tpot-ms", type=optional_ms, default=100.0, help="TPOT SLO for goodput ('none': off)")
    ap.add_argument("--slo-ttft-ms", type=optional_ms, default=None, help="TTFT SLO for goodput")
    ap.add_argument("--slo-e2el-ms", type=optional_ms, default=None, help="end-to-end latency SLO for goodput")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default runs/loadtest/<time>)")
    ap.add_argument("--label", default="", help="name of this run in merged plots (loadtest.report)")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.policies is None:  # with --url there is one server, whatever policy it runs: one series
        args.policies = ["server"] if args.url else ["none", "mtp1", "dspark"]
    if args.server_warmup < 0:
        ap.error(f"--server-warmup must be >= 0, got {args.server_warmup}")
    check_server_flags(ap, args, started="the servers the sweep starts")
    if not 0 <= args.max_tokens_range_ratio < 1:
        ap.error(f"--max-tokens-range-ratio must be in [0, 1), got {args.max_tokens_range_ratio}")
    try:  # fail now, not inside the first Locust process; each level gets its slice of the lines (level_offsets)
        args.prompt_lines = len(load_prompt_spec(args.prompts))
    except (ValueError, FileNotFoundError) as err:
        ap.error(str(err))
    args.system_prompt = ""
    if args.system_prompt_file is not None:
        try:
            args.system_prompt = args.system_prompt_file.read_text(encoding="utf-8").strip()
        except OSError as err:
            ap.error(f"--system-prompt-file: {err}")
        if not args.system_prompt:
            ap.error(f"--system-prompt-file: {args.system_prompt_file} is empty")
    args.out = args.out or REPO_ROOT / "runs" / "loadtest" / time.strftime("%Y%m%d-%H%M%S")
    if args.out.exists() and not args.out.is_dir():
        ap.error(f"--out {args.out} is a file, not a folder")
    if earlier := earlier_run(args.out):
        ap.error(f"--out {args.out} holds an earlier run ({', '.join(earlier)}): choose another folder or remove it")
    if not args.url and (refused := check_configs(args)):
        ap.error(f"{refused} (nothing started)")
    return args


def check_configs(args: argparse.Namespace) -> str | None:
    """What the builder refuses in the application the sweep would start for each policy (``--config``, ``--set``,
    the policy), one line; None when it accepts them all. Runs ``python -m loadtest.server --check`` (the builder
    imports Ray, which this process does not)."""
    cmd = [sys.executable, "-m", "loadtest.server", "--config", str(args.config), "--check", ",".join(args.policies)]
    cmd += [a for o in args.overrides for a in ("--set", o)]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    if done.returncode == 0:
        return None
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    if done.returncode == 2:  # a usage error: its last line, without the program's name
        return lines[-1].partition("error: ")[2] or lines[-1] if lines else f"{cmd} exited with 2"
    return "; ".join(lines) or f"{cmd} exited with {done.returncode}"


def earlier_run(out: Path) -> list[str]:
    """The files and folders of a run (``RUN_FILES``) already in ``out``: a new run there would mix with them."""
    return sorted(p.name for pattern in RUN_FILES for p in out.glob(pattern)) if out.is_dir() else []


def locust_env(args: argparse.Namespace, *, model: str, records: Path, prompt_offset: int) -> dict:
    env = dict(os.environ)
    env.update({
        "LOADTEST_PROMPTS": args.prompts, "LOADTEST_PROMPT_SEED": str(args.prompt_seed),
        "LOADTEST_PROMPT_OFFSET": str(prompt_offset), "LOADTEST_MODEL": model,
        "LOADTEST_MAX_TOKENS": str(args.max_tokens),
        "LOADTEST_MAX_TOKENS_RANGE_RATIO": str(args.max_tokens_range_ratio),
        "LOADTEST_TEMPERATURE": str(args.temperature), "LOADTEST_RECORDS": str(records),
        "LOADTEST_API_KEY": args.api_key, "LOADTEST_SYSTEM_PROMPT": args.system_prompt,
    })
    flags = ((args.ignore_eos, "LOADTEST_IGNORE_EOS"), (args.no_spec_stats, "LOADTEST_NO_SPEC_STATS"),
             (args.multi_turn, "LOADTEST_MULTI_TURN"))
    for flag, name in flags:
        if flag:
            env[name] = "true"
        else:
            env.pop(name, None)
    return env


def level_seconds(args: argparse.Namespace) -> int:
    """Locust's run time per level: ramp-up, warm-up and measured seconds (the window starts once all users are
    spawned, within the first second)."""
    return math.ceil(args.warmup + args.duration) + 1


def wait_ticking(process: subprocess.Popen, *, timeout_s: float, tick: Callable[[float], None]) -> int | None:
    """``process``'s exit status, calling ``tick(seconds since the wait began)`` about once a second meanwhile;
    None when it has not ended after ``timeout_s``."""
    start = time.monotonic()
    while True:
        try:
            return process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            elapsed = time.monotonic() - start
            if elapsed > timeout_s:
                return None
            tick(elapsed)


def run_locust(args: argparse.Namespace, *, url: str, model: str, users: int, name: str, prompt_offset: int,
               tick: Callable[[float], None] = lambda elapsed: None) -> Path:
    """One headless Locust run at ``users`` users, its prompts from line ``prompt_offset`` of the seeded order on;
    returns its records file. ``tick(seconds since it started)`` runs about once a second while it runs; Locust is
    killed when this ends otherwise (a KeyboardInterrupt).

    Raises:
        RuntimeError: Locust failed or hung (with its output's tail).
    """
    records = args.out / "records" / f"{name}.jsonl"
    records.parent.mkdir(parents=True, exist_ok=True)
    records.unlink(missing_ok=True)
    (args.out / "locust").mkdir(parents=True, exist_ok=True)
    run_time = level_seconds(args)
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--users", str(users),
           "--spawn-rate", str(users), "--run-time", f"{run_time}s", "--stop-timeout", f"{args.drain_timeout:g}",
           "--host", url, "--csv", str(args.out / "locust" / name), "--only-summary", "--loglevel", "WARNING",
           "--exit-code-on-error", "0"]
    log = args.out / "locust" / f"{name}.log"
    env = locust_env(args, model=model, records=records, prompt_offset=prompt_offset)
    with log.open("w") as f:
        process = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            returncode = wait_ticking(process, timeout_s=run_time + args.drain_timeout + LOCUST_GRACE_S, tick=tick)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    if returncode is None:
        raise RuntimeError(f"Locust hung at {name}; see {log}")
    if returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"Locust exited with {returncode} at {name}:\n{tail}")
    return records


def auth(api_key: str) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def first_model(url: str, api_key: str) -> str:
    """The first model an external server lists (``--model`` not given)."""
    r = httpx.get(f"{url}/v1/models", headers=auth(api_key), timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def warm_up(url: str, *, model: str, api_key: str, requests: int) -> None:
    """A few short unmeasured requests (first-call costs: allocation, lazy initialisation), on prompts of their own:
    one from a prompt set could sit in the prefix cache when a level sends it."""
    for i in range(requests):
        body = {"model": model, "max_tokens": 16, "temperature": 0,
                "messages": [{"role": "user", "content": f"Warm-up request {i + 1}: count from one to ten."}]}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=auth(api_key), timeout=300)
        if r.status_code != 200:
            raise RuntimeError(f"warm-up request failed: HTTP {r.status_code}: {r.text[:300]}")


def first_error(records: list) -> str | None:
    """The error of the first failed request (by start time) of a level; None when every request succeeded."""
    failed = [r for r in records if not r.ok]
    return min(failed, key=lambda r: r.start).error if failed else None


def slo_of(args: argparse.Namespace) -> Slo:
    return Slo(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms, e2el_ms=args.slo_e2el_ms)


def run_level(args: argparse.Namespace, *, url: str, model: str, policy: str, users: int, prompt_offset: int,
              counters: dict, progress: tqdm) -> tuple[dict, dict]:
    """One level: Locust at ``users`` users, its prompts from ``prompt_offset`` on; returns its results and the server's
    round counters after it (``counters``: those before it)."""
    slo, name, seconds, shown = slo_of(args), level_name(policy, users), level_seconds(args), [0]

    def tick(elapsed: float) -> None:  # the bar moves by the level's seconds (the drain's shown at its end)
        step = min(int(elapsed), seconds) - shown[0]
        shown[0] += step
        progress.update(step)

    records, markers = read_records(run_locust(args, url=url, model=model, users=users, name=name,
                                               prompt_offset=prompt_offset, tick=tick))
    tick(seconds)
    window = measurement_window(markers, warmup_s=args.warmup, duration_s=args.duration)
    after = settled_counters(url, headers=auth(args.api_key))
    level = {"policy": policy, "concurrency": users, "temperature": args.temperature, **summarize(records, window, slo),
             **round_split(counters, after), "prompt_offset": prompt_offset, "first_error": first_error(records)}
    if level["first_error"] is not None:
        progress.write(f"{name}: {level['completed']} requests succeeded, {level['failed']} failed; the first "
                       f"failure: {level['first_error']}", file=sys.stderr)
    conversations, lines = sum(r.turn == 0 for r in records), args.prompt_lines // len(args.concurrency)
    if conversations > lines:
        progress.write(f"{name}: sent {conversations} prompt lines, more than its slice of {lines}: the rest were "
                       "the next slice's (more --prompts lines, or fewer or shorter levels, avoid it)", file=sys.stderr)
    return level, after


def run_sweep(args: argparse.Namespace, config: dict, levels: list[dict], errors: list[dict]) -> None:
    """Every (policy, level): appends each finished level's results to ``levels`` and the error of each policy that
    failed to ``errors`` (what was appended stays there when a KeyboardInterrupt ends the sweep). Level i of every
    policy sends the prompt lines from ``level_offsets(...)[i]`` on."""
    slo = slo_of(args)
    offsets = level_offsets(args.prompt_lines, len(args.concurrency))
    progress = tqdm(total=len(args.policies) * len(args.concurrency) * level_seconds(args), desc="sweep", unit="s",
                    file=sys.stderr, bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} s "
                    "[{elapsed}<{remaining}{postfix}]")
    try:
        for i, policy in enumerate(args.policies):
            progress.set_description(f"{policy}: starting")
            server = nullcontext() if args.url else ManagedServer(
                config=args.config, overrides=[*args.overrides, f"policy={policy}"], port=args.port,
                num_cpus=args.num_cpus, log_path=args.out / f"server-{policy}.log",
                ready_timeout_s=args.server_timeout, api_key=args.api_key)
            try:
                with server:
                    url = args.url or server.url
                    if args.url:
                        progress.set_description(f"{policy}: waiting for {url}/health")
                        wait_ready(url, headers=auth(args.api_key), timeout_s=args.server_timeout)
                    model = args.model or (server.model if not args.url else first_model(url, args.api_key))
                    warm_up(url, model=model, api_key=args.api_key, requests=args.server_warmup)
                    counters = settled_counters(url, headers=auth(args.api_key))
                    for users, offset in zip(args.concurrency, offsets):
                        progress.set_description(f"{policy} c={users}")
                        level, counters = run_level(args, url=url, model=model, policy=policy, users=users,
                                                    prompt_offset=offset, counters=counters, progress=progress)
                        levels.append(level)
                        write_level(args.out, level, slo.to_json())
                        write_results(args.out, config=config, slo=slo.to_json(), levels=levels)
                        progress.set_postfix(tok_s=f"{level['output_throughput']:.1f}",
                                             user_tok_s=f"{level['median_user_tok_s'] or 0:.1f}")
            except (RuntimeError, ValueError, httpx.HTTPError) as err:
                errors.append({"policy": policy, "error": str(err)})
                progress.write(f"policy {policy} failed: {err}", file=sys.stderr)
                progress.update((i + 1) * len(args.concurrency) * level_seconds(args) - progress.n)  # its levels
    finally:
        progress.close()


def run_config(args: argparse.Namespace) -> dict:
    keys = ("concurrency", "duration", "warmup", "drain_timeout", "policies", "url", "model", "overrides",
            "num_cpus", "prompts", "prompt_seed", "max_tokens", "max_tokens_range_ratio", "temperature", "ignore_eos",
            "multi_turn", "label")
    config = {k: getattr(args, k) for k in keys}
    config.update(config_file=None if args.url else str(args.config), argv=args.argv,
                  system_prompt_file=None if args.system_prompt_file is None else str(args.system_prompt_file),
                  started=time.strftime("%Y-%m-%dT%H:%M:%S%z"), machine=platform.platform(),
                  cpus=os.cpu_count())
    return config


def _interrupt(signum: int, frame) -> None:
    """SIGINT or SIGTERM: stop as Ctrl-C does, so the started server (in its own session) is stopped on the way out;
    a second signal while that happens is ignored."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt(signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    config = run_config(args)
    levels, errors = [], []
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        run_sweep(args, config, levels, errors)
    except KeyboardInterrupt as stop:
        signum = stop.args[0] if stop.args else signal.SIGINT
        json_path, _ = write_results(args.out, config={**config, "errors": errors,
                                                        "stopped_by": signal.Signals(signum).name},
                                     slo=slo_of(args).to_json(), levels=levels)
        print(f"sweep stopped by {signal.Signals(signum).name}: {len(levels)} finished levels are kept in {json_path}",
              file=sys.stderr)
        return 128 + signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    json_path, csv_path = write_results(args.out, config={**config, "errors": errors}, slo=slo_of(args).to_json(),
                                        levels=levels)
    plot = pareto_plot(levels, args.out / "pareto.png", slo_tpot_ms=args.slo_tpot_ms,
                       title=f"Throughput vs interactivity{' - ' + args.label if args.label else ''}")
    print(format_table(levels))
    keep = ("policy", "concurrency", "completed", "failed", "output_throughput", "median_user_tok_s", "p90_tpot_ms",
            "request_goodput", "mean_accepted_length", "mean_verify_length", "prefix_cache_hit_rate",
            "p50_ttft_ms_later_turns")
    failed_requests = sum(lv["failed"] for lv in levels)
    print(json.dumps({"results": str(json_path), "csv": str(csv_path), "plot": str(plot),
                      "errors": len(errors) + failed_requests, "failed_requests": failed_requests,
                      "levels": [{k: lv.get(k) for k in keep} for lv in levels]}))
    if hopeless := [level_name(lv["policy"], lv["concurrency"]) for lv in levels if not lv["completed"]]:
        print(f"no request succeeded at {', '.join(hopeless)}", file=sys.stderr)
    return 1 if errors or hopeless else 0


if __name__ == "__main__":
    sys.exit(main())
