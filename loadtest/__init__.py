"""Load testing: a Locust user streaming OpenAI chat completions, concurrency sweeps and Pareto reports.

Modules: ``stream`` (SSE decoding and per-request timing, no I/O), ``metrics`` (aggregation per level),
``prompts`` (prompt sets), ``locustfile`` (the Locust user; imported only inside a Locust process, since
Locust monkey-patches with gevent), ``server`` (starts the Serve application in a child process),
``sweep`` (the sweep runner), ``report`` (results files, table, Pareto plot, merging runs) and
``vllm_peer`` (exports the default model for vLLM's CPU build, the comparison peer).
Nothing here imports Locust, Ray or torch at package import time.
"""
