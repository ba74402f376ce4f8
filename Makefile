# Manta — `make run` trains the tiny local model; `make test` runs the CPU test suite.
# Both set up what they need on first use (Python venv with torch==2.11.0 for libtorch,
# plus transformers / openreward / tensorboard for interop tests, wandb for --wandb-project)
# and are idempotent; editing requirements-dev.txt re-runs the install.

SHELL := /bin/bash
PYTHON ?= python3
VENV := $(CURDIR)/.venv
VENV_PY := $(VENV)/bin/python
# Whatever python minor version the venv has. Recursive (=) and asked of the shell each
# time, so a venv that `setup` creates during this make run is found by the recipes that
# follow it (make's own $(wildcard) caches the directory listing it saw before setup ran).
TORCH_LIB = $(shell ls -d $(VENV)/lib/python3*/site-packages/torch/lib 2>/dev/null | head -n 1)
SETUP_STAMP := $(VENV)/.manta-setup-v1

# torch-sys finds libtorch through the venv's python. driver, worker and the bench binaries
# carry a run path to it (crates/libtorch-link); other crates' test binaries find it here.
export PATH := $(VENV)/bin:$(PATH)
export LIBTORCH_USE_PYTORCH := 1
CALLER_LD_LIBRARY_PATH := $(LD_LIBRARY_PATH)
export LD_LIBRARY_PATH = $(TORCH_LIB)$(if $(CALLER_LD_LIBRARY_PATH),:$(CALLER_LD_LIBRARY_PATH))
export MANTA_PYTHON := $(VENV_PY)

CARGO_TEST_FLAGS ?=
# The sources of every binary target (their tests would not run: see `test`).
BIN_SOURCES = bench/src/bin/*.rs actors/driver/src/main.rs actors/driver/src/worker_main.rs

.PHONY: run test test-gpu setup build lint fmt clean-runs help

help:
	@echo "make run    - train the tiny model locally on CPU (cluster.toml, configs/local-tiny.toml)"
	@echo "make test   - run the whole CPU test suite"
	@echo "make test-gpu - on a GPU node: every GPU test on every GPU (bin/tests from bench/run_gpu_tests.sh build)"
	@echo "make setup  - create .venv (torch==2.11.0, transformers, openreward, tensorboard, wandb)"
	@echo "make lint   - unused-dependency check, cargo fmt --check, cargo clippy --all-targets (warnings denied)"
	@echo "make fmt    - cargo fmt --all"

setup: $(SETUP_STAMP)

$(SETUP_STAMP): requirements-dev.txt
	@echo "== setting up $(VENV) (first run downloads torch, ~4.6 GB)"
	@test -x $(VENV_PY) || $(PYTHON) -m venv $(VENV)
	$(VENV_PY) -m pip install --quiet --no-cache-dir --disable-pip-version-check -r requirements-dev.txt
	@$(VENV_PY) -c "import torch; assert torch.__version__.startswith('2.11.0'), torch.__version__"
	@touch $@

build: setup
	cargo build --release --bin driver

run: build
	./target/release/driver --cluster cluster.toml --train-settings configs/local-tiny.toml

test: setup
	$(VENV_PY) tools/test_check_layers.py
	$(VENV_PY) tools/check_layers.py
	$(VENV_PY) tools/test_check_modules.py
	$(VENV_PY) tools/check_modules.py
	@# Unit tests live in the libraries: a binary's own test harness (14 of them, each a
	@# full link) would run nothing, and no doc comment holds an example to run.
	@if grep -lE '#\[(tokio::)?test|#\[cfg\(test\)\]' $(BIN_SOURCES); then \
		echo "error: the files above hold unit tests, which 'make test' does not build in a binary: move them into the crate's library"; exit 1; fi
	cargo test --workspace --lib --test '*' $(CARGO_TEST_FLAGS)

# On the GPU node, with bin/tests built here by `bench/run_gpu_tests.sh build` and carried
# there; fails when no GPU is visible.
test-gpu:
	bash bench/run_gpu_tests.sh

lint: setup
	$(VENV_PY) tools/test_check_unused_deps.py
	$(VENV_PY) tools/check_unused_deps.py
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings

fmt:
	cargo fmt --all

clean-runs:
	rm -rf runs checkpoints
