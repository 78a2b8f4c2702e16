# Fresh-machine entry points: `make demo` and `make test` (each sets up .venv first).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test setup bench zoo clean fuzz soak distributed pyc

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# the distributed extra (in dev) needs torch for its gloo collective: the CPU build first,
	# else pip would pick a multi-GB CUDA build to satisfy it
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet 'torch==2.13.0'
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	# a trained model for the test suite: silero-vad's wheel ships ONNX files (its torch
	# dependency is not needed for them, hence --no-deps); tests/models/test_silero_vad.py
	$(BIN)/python -m pip install --quiet --no-deps 'silero-vad==6.2.3'
	$(MAKE) --no-print-directory pyc
	touch $(STAMP)

# bytecode for apollo_py's modules, as a regular (non-editable) install writes it: with
# PYTHONDONTWRITEBYTECODE set (this box) every process otherwise compiles them from source
# (~0.1 s CPU for the modules a compile imports; docs/design/compile_time.md); stale files are
# ignored by Python
pyc:
	$(BIN)/python -m compileall -q apollo_py

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP) pyc
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

# differential testing at scale (issue #16): 10,000 random graphs (five dtypes) cpu vs reference,
# 2,000 mutated example models + 300 mutated zoo exports (only ApolloError may come out, naming
# the node or input); fixed seeds, see tools/fuzz.py
fuzz: $(STAMP)
	$(BIN)/python tools/fuzz.py --graphs 10000 --mutations 2000 --zoo-mutations 300

# soak (issue #16 item 7): 100,000 calls of a small model, 1,000 of a large one (the zoo's
# full-size DLRM, if `make zoo` exported it), shape churn, SIGKILLed compiles, interpreter exit;
# RSS and open fds must stay flat (tolerances in tools/soak.py)
soak: $(STAMP)
	$(BIN)/python tools/soak.py

# apollo_py.distributed on a two-node Ray cluster started on the loopback address (head + worker
# node as separate processes; slow, so not in `make test`): tests/distributed/test_cluster.py
distributed: $(STAMP)
	APOLLO_PY_CLUSTER_TEST=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/distributed/test_cluster.py $(PYTEST_ARGS)

# the benchmark table with every contender (benchmarks/README.md): the bench extra (jax, OpenVINO)
# is installed here, never by `make test`; torch.compile runs where torch is installed
bench: $(STAMP)
	$(BIN)/python -c "import jax, openvino" 2>/dev/null || $(BIN)/python -m pip install --quiet -e '.[dev,bench]'
	$(BIN)/python benchmarks/run.py $(BENCH_ARGS)

# The model zoo (benchmarks/zoo): export the full-size models once (~/.cache/apollo_py_zoo, or
# $APOLLO_PY_ZOO_DIR; needs the zoo extra: torch, torchvision, timm, transformers, onnxscript),
# then the table (benchmarks/zoo.py; ZOO_ARGS="--only gpt2 --limit 120 --write-results" etc.).
zoo: $(STAMP) pyc
	$(BIN)/python -c "import torch, torchvision, timm, transformers, onnxscript" 2>/dev/null \
		|| $(BIN)/python -m pip install --quiet -e '.[dev,zoo]'
	# OpenVINO-f32 column of the zoo table (the bench extra; torch.compile comes with the zoo extra)
	$(BIN)/python -c "import openvino" 2>/dev/null || $(BIN)/python -m pip install --quiet -e '.[dev,bench]'
	# trained PP-OCR models (paddle2onnx exports) ship in this wheel; only its .onnx files are used
	$(BIN)/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('rapidocr_onnxruntime') is None)" \
		|| $(BIN)/python -m pip install --quiet --no-deps 'rapidocr-onnxruntime==1.4.4'
	$(BIN)/python benchmarks/zoo/export.py --size full
	$(BIN)/python benchmarks/zoo.py $(ZOO_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
