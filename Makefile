# Everyday targets. `make test` is what CI runs (.ci/run); `make run` runs the embedded default.
PY ?= python3
export PYTHONUNBUFFERED = 1

.PHONY: setup run serve serve-demo test test-fast test-slow lint format typecheck dry-run bench clean

setup:
	PYTHON=$(PY) bash scripts/setup.sh

# ARGS: Hydra overrides, e.g. make run ARGS="opd.steps=3 eval.extra_sets=[validation]"
run: setup
	$(PY) -m draft_opd_ray.main $(ARGS)

# vLLM's OpenAI server on the target and the draft, the draft learning from the traffic it verifies
# (docs/usage.md, "Serve and learn"); ARGS as for run, e.g. make serve ARGS="serve.port=8001"
serve: setup
	$(PY) -m draft_opd_ray.serve $(ARGS)

# The server learning from replayed ShareGPT traffic against the same server with its draft fixed (~20 min on a
# 2-core CPU box): tau over time with intervals, latency around refits, a plot; ARGS: the demo's options
serve-demo: setup
	$(PY) -m draft_opd_ray.serve.demo $(ARGS)

lint: setup
	$(PY) -m ruff check draft_opd_ray tests bench
	$(PY) -m ruff format --check draft_opd_ray tests bench

format: setup
	$(PY) -m ruff format draft_opd_ray tests bench
	$(PY) -m ruff check --fix draft_opd_ray tests bench

typecheck: setup
	$(PY) -m mypy

# Default suite: tests/unit + tests/conformance (our vLLM arguments and hooks against vLLM's GPU-side code, no
# engine, no GPU) + tests/integration (real vLLM CPU engine, Ray, DeepSpeed) + tests/docs (the README's commands);
# slow end-to-end runs (tests/e2e) excluded.
test: lint typecheck
	bash scripts/pytest.sh -m "not slow" --durations=15

# tests/unit: no vLLM engine, Ray cluster or DeepSpeed engine (tests/unit/conftest.py fails a test that starts one).
test-fast: setup
	bash scripts/pytest.sh tests/unit

test-slow: setup
	bash scripts/pytest.sh -m slow

# Benchmarks P0-P7 (targets in docs/benchmarks.md): slow, meant for a quiet machine; results go to docs/benchmarks.md.
bench: setup
	$(PY) bench/bench_loss_memory.py
	$(PY) bench/bench_rollout.py
	$(PY) bench/bench_weight_sync.py
	$(PY) bench/bench_threads.py

dry-run: setup
	$(PY) -m draft_opd_ray.main +cluster=8xA100 dry_run=true

clean:
	rm -rf outputs multirun .mypy_cache .ruff_cache
