# Two commands on a fresh machine: `make train` (set up, then train the embedded default)
# and `make test` (set up, then run the test suite; `make test-fast` for the fast tier).
# All create .venv if it is missing.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: setup train moe stdlib test test-fast test-profile test-fast-newest clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

train: $(STAMP)
	$(VENV)/bin/python -m meshtrain.train --config configs/tiny.yaml --host-devices 8 run.dir=runs/tiny-$$(date +%Y%m%d-%H%M%S)

# The same data through a tiny mixture of experts (8 experts, top-2), experts split 4 ways by expert
# parallelism over data x fsdp (configs/moe_tiny.yaml).
moe: $(STAMP)
	$(VENV)/bin/python -m meshtrain.train --config configs/moe_tiny.yaml --host-devices 8 run.dir=runs/moe_tiny-$$(date +%Y%m%d-%H%M%S)

# Real text, no download: the installed standard library's docstrings -> a BPE tokenizer -> a
# prepared directory (documents, 10% held out) -> training with evaluation (configs/stdlib_docs.yaml).
stdlib: $(STAMP)
	$(VENV)/bin/python scripts/stdlib_docstrings.py --out data/stdlib_docstrings.jsonl
	$(VENV)/bin/python -m meshtrain.data train-tokenizer --input data/stdlib_docstrings.jsonl --vocab-size 2048 --out data/stdlib_tokenizer --overwrite
	$(VENV)/bin/python -m meshtrain.data prepare --tokenizer data/stdlib_tokenizer --input data/stdlib_docstrings.jsonl --out data/stdlib_docs --val-fraction 0.1 --overwrite
	$(VENV)/bin/python -m meshtrain.train --config configs/stdlib_docs.yaml --host-devices 8 run.dir=runs/stdlib_docs-$$(date +%Y%m%d-%H%M%S)

# Supervised fine-tuning of that model (docs/sft.md): one-line summaries of the standard library's functions,
# classes and methods as instructions (pairs and two-turn chats) -> prepare-sft with the run's tokenizer and
# the built-in chat template (10% held out; loss on the responses only) -> the newest `make stdlib` run with
# a checkpoint, exported once, fine-tuned by configs/stdlib_sft.yaml. Runs `make stdlib` first if there is none.
.PHONY: sft
sft: $(STAMP)
	ls -d runs/stdlib_docs-*/checkpoints/[0-9]* >/dev/null 2>&1 || $(MAKE) stdlib
	$(VENV)/bin/python scripts/stdlib_instructions.py --out data/stdlib_instructions.jsonl
	base=$$(ls -d runs/stdlib_docs-*/checkpoints/[0-9]* | sed 's|/checkpoints/.*||' | sort -u | tail -1) && \
	echo "fine-tuning $$base" && \
	{ test -d $$base/export/params || $(VENV)/bin/python -m meshtrain.export --run $$base --out $$base/export; } && \
	$(VENV)/bin/python -m meshtrain.data prepare-sft --tokenizer $$base/tokenizer.json --input data/stdlib_instructions.jsonl --out data/stdlib_sft --val-fraction 0.1 --overwrite && \
	$(VENV)/bin/python -m meshtrain.train --config configs/stdlib_sft.yaml --host-devices 8 checkpoint.init_from=$$base/export run.dir=runs/stdlib_sft-$$(date +%Y%m%d-%H%M%S)

# The same fine-tune by LoRA (configs/stdlib_lora.yaml: rank-16 adapters, the base frozen in bf16), then its
# adapters written as a PEFT directory (RUN/peft: adapter_config.json + adapter_model.safetensors).
.PHONY: lora
lora: $(STAMP)
	ls -d runs/stdlib_docs-*/checkpoints/[0-9]* >/dev/null 2>&1 || $(MAKE) stdlib
	$(VENV)/bin/python scripts/stdlib_instructions.py --out data/stdlib_instructions.jsonl
	base=$$(ls -d runs/stdlib_docs-*/checkpoints/[0-9]* | sed 's|/checkpoints/.*||' | sort -u | tail -1) && \
	run=runs/stdlib_lora-$$(date +%Y%m%d-%H%M%S) && echo "LoRA fine-tuning $$base into $$run" && \
	{ test -d $$base/export/params || $(VENV)/bin/python -m meshtrain.export --run $$base --out $$base/export; } && \
	$(VENV)/bin/python -m meshtrain.data prepare-sft --tokenizer $$base/tokenizer.json --input data/stdlib_instructions.jsonl --out data/stdlib_sft --val-fraction 0.1 --overwrite && \
	$(VENV)/bin/python -m meshtrain.train --config configs/stdlib_lora.yaml --host-devices 8 checkpoint.init_from=$$base/export run.dir=$$run && \
	$(VENV)/bin/python -m meshtrain.convert to-peft --run $$run --out $$run/peft --host-devices 8

# Both tiers run on one pytest-xdist worker per core (at most 4: every worker simulates 8 devices);
# `.venv/bin/python -m pytest -q` runs them in one process. Their times are in README.md. The test
# marked rehearsal (scripts/gpu_check.sh --dry-run's report) runs in make gpu-rehearsal instead.
test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n auto --maxprocesses 4 -m "not rehearsal"

test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n auto --maxprocesses 4 -m "not slow and not rehearsal"

# The whole suite with tests/suite_profile.py: per test file, wall time and JAX's tracing, lowering and
# compile seconds (.suite-profile/summary.json), the costliest files printed at the end.
test-profile: $(STAMP)
	PYTHONPATH=tests $(VENV)/bin/python -m pytest -q -n auto --maxprocesses 4 -p suite_profile -m "not rehearsal"

# The other end of the supported JAX range, in a second venv: jax 0.11 and later need Python >= 3.12,
# so .venv on Python 3.11 has the oldest supported jax and this one the newest that pyproject.toml
# allows (pip upgrades it to that at every change of pyproject.toml). CI runs the fast tier here.
PYTHON_NEWEST ?= python3.12
VENV_NEWEST := .venv-newest
STAMP_NEWEST := $(VENV_NEWEST)/.installed

$(STAMP_NEWEST): pyproject.toml
	test -d $(VENV_NEWEST) || $(PYTHON_NEWEST) -m venv $(VENV_NEWEST)
	$(VENV_NEWEST)/bin/pip install -q --upgrade pip
	$(VENV_NEWEST)/bin/pip install -q --upgrade --upgrade-strategy eager -e ".[dev]"
	touch $(STAMP_NEWEST)

test-fast-newest: $(STAMP_NEWEST)
	$(VENV_NEWEST)/bin/python -m pytest -q -n auto --maxprocesses 4 -m "not slow and not rehearsal"

# XLA:GPU without a GPU (docs/gpu.md): .venv-gpu (python3.12) with the pinned jax + CUDA 13 plugin + cuDNN wheels
# (pyproject.toml's gpu-compile extra), where `python -m meshtrain.compile` compiles the train step for compile-only
# H100/H200/B200 devices. test-gpu-compile is the CI tier that compiles the layout matrix there (tests_gpu/).
VENV_GPU := .venv-gpu
STAMP_GPU := $(VENV_GPU)/.installed

$(STAMP_GPU): pyproject.toml
	test -d $(VENV_GPU) || $(PYTHON_NEWEST) -m venv $(VENV_GPU)
	$(VENV_GPU)/bin/pip install -q --upgrade pip
	$(VENV_GPU)/bin/pip install -q -e ".[gpu-compile]"
	touch $(STAMP_GPU)

.PHONY: setup-gpu-compile test-gpu-compile
setup-gpu-compile: $(STAMP_GPU)

test-gpu-compile: $(STAMP_GPU)
	$(VENV_GPU)/bin/python -m pytest -q -n 2 -p no:cacheprovider tests_gpu

# The bare GPU machine rehearsed (scripts/gpu_rehearsal.sh): a Python 3.12 venv with only its packages (jax
# 0.11.2, flax, optax, ...), scripts/gpu_wheels.sh for what meshtrain needs beyond them, and
# scripts/gpu_check.sh --dry-run installing those wheels into .gpu_site. Needs PyPI; CI runs it.
.PHONY: gpu-rehearsal
gpu-rehearsal: $(STAMP)
	scripts/gpu_rehearsal.sh $(PYTHON_NEWEST)

clean:
	rm -rf $(VENV) $(VENV_NEWEST) $(VENV_GPU) runs data .pytest_cache

# Docs that stay true (issue 52). docs-check runs every command that README.md and docs/*.md show, in the order
# shown, from a fresh clone sharing .venv (scripts/check_docs.py: DOCS="docs/a.md docs/b.md" for those files',
# `python scripts/check_docs.py --list` for the commands and the ones marked not runnable here).
# docs-figures trains the shipped configs the docs quote and reruns the commands whose output they show, and
# rewrites those figures in place (scripts/docs_figures.py; --check only reports the ones that moved).
.PHONY: docs-check docs-figures
docs-check: $(STAMP)
	$(VENV)/bin/python scripts/check_docs.py $(addprefix --file ,$(DOCS))

docs-figures: $(STAMP)
	$(VENV)/bin/python scripts/docs_figures.py
