# Two entry points for a fresh machine (README): `make demo` and `make test`.
# Both create .venv when missing and install dsclip with `pip install -e .[dev]`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# This machine's pip serves these torch/torchvision builds from local disk; override on other hosts.
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
# Private, persistent JIT cache for DeepSpeed's CPU ops (see DEEPSPEED-NOTES: ninja rebuilds otherwise).
# Per checkout (= per venv): two ninja binaries alternating on one cache rebuild the op every time.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
PYTEST_ARGS ?=

.PHONY: venv demo test test-all lint clean

$(VENV)/.installed: setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) -m dsclip train --config dsclip/recipes/demo.yaml --logs runs --name demo $(ARGS)

test: venv
	$(PY) -m ruff check dsclip tests bench
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# Also the scale smoke tests (ViT-H-14 / ViT-bigG-14 under ZeRO-3 on 2 CPU ranks, ~10 min, ~15 GB RAM).
test-all: venv
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(PYTEST_ARGS)

lint: venv
	$(PY) -m ruff check dsclip tests bench
	$(PY) -m ruff format --check dsclip tests bench

clean:
	rm -rf runs .pytest_cache .ruff_cache
