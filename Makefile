# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch; installed first so nothing pulls a CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo test test-fast test-matrix bench lint docs clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	# constraints.txt pins a set known to resolve together (botocore within aiobotocore's range).
	$(PIP) install -q -c constraints.txt -e ".[test,ft]"
	touch $@

install: $(VENV)/.installed

# Train a tiny GPT with ZeRO-2 on 2 CPU processes (async sharded checkpoints every 20 steps), resume
# from the last checkpoint on 3 processes (the optimizer state is resharded 2 -> 3), export it with
# `lightning-zero convert`, and print what every checkpoint cost (examples/demo.py).
DEMO_DIR ?= runs/demo
demo: install
	$(PY) examples/demo.py --root $(DEMO_DIR)

test: install
	$(PY) -m pytest -q -ra

# The quick loop: neither the e2e tier (tests that start fresh interpreters: the command, configs, demo,
# examples, torchrun, bench scripts, peer loss; marked in tests/conftest.py) nor the slow Lightning runs.
test-fast: install
	$(PY) -m pytest -q -ra -m "not e2e and not slow"

# One virtual environment per supported Python x torch x Lightning combination (under .matrix/), each
# running the fast tests; results in .matrix/results.txt, recorded in COMPATIBILITY.md. Not run by CI.
test-matrix:
	nice -n 10 .ci/test-matrix

bench: install
	$(PY) bench/engine.py
	$(PY) bench/step_overhead.py
	$(PY) bench/checkpoint.py
	$(PY) bench/trainer_checkpoint.py
	$(PY) bench/trainer_checkpoint.py --one-rank
	$(PY) bench/save_phases.py
	$(PY) bench/save_cost_parts.py --rounds 2
	$(PY) bench/save_cost_parts.py --phases --model deep
	$(PY) bench/write_loop.py
	$(PY) bench/recovery.py
	$(PY) bench/fault_tolerance.py
	$(PY) bench/s3_clients.py

# DeepSpeed ZeRO-1/2 as rows of bench/engine.py, on its CPU accelerator with no prebuilt ops. Installed
# into a folder of its own (not the venv, not the test extras), with the few pure-Python packages it
# imports that the venv lacks; at start it JIT-builds its shared-memory op with the system's g++.
.PHONY: litgpt-check lightning-tests
# Programs written elsewhere, each in a venv of its own under clients/ (not CI; results in COMPATIBILITY.md):
# litgpt 0.5.13's pre-training, full fine-tuning and LoRA scripts with their strategy line changed to the bare
# "zero2" (and `import lightning_zero`), resumed, then litgpt's own tools (`generate`, `merge_lora`) on their output;
# Lightning's own tests with zero2 in place of DDP against a pass-through control.
litgpt-check:
	nice -n 10 clients/litgpt/check.sh
lightning-tests:
	clients/lightning_tests/run.sh

.PHONY: bench-peers
PEERS_DIR ?= .bench-peers
DEEPSPEED_SPEC ?= deepspeed==0.19.8
bench-peers: install
	DS_BUILD_OPS=0 $(PIP) install -q --target $(PEERS_DIR) --no-deps "$(DEEPSPEED_SPEC)" hjson py-cpuinfo ninja msgpack einops
	DS_ACCELERATOR=cpu DS_BUILD_OPS=0 PYTHONPATH=$(PEERS_DIR) $(PY) bench/engine.py --peers --methods ddp zero1 zero2 deepspeed_zero1 deepspeed_zero2
	DS_ACCELERATOR=cpu DS_BUILD_OPS=0 PYTHONPATH=$(PEERS_DIR) $(PY) bench/checkpoint.py --peers

# The documentation site (docs/, mkdocs.yml) into site/ (SITE_DIR), the API reference and the root's
# ARCHITECTURE.md, BENCHMARKS.md and COMPATIBILITY.md included: MkDocs, Material and mkdocstrings at the
# versions of docs-requirements.txt go into a folder of their own, not the venv, and read the package's sources
# without importing them (no torch needed). --strict: a broken link, anchor or reference fails, and so does
# any href or src of the built pages that names no file of the site (docs/site_build.py checks them).
DOCS_VENV ?= .docs-venv
SITE_DIR ?= site
$(DOCS_VENV)/.installed: docs-requirements.txt
	$(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/pip install -q -r docs-requirements.txt
	touch $@

docs: $(DOCS_VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --strict --site-dir "$(SITE_DIR)"

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) $(DOCS_VENV) .pytest_cache lightning_logs runs site
