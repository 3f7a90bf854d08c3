# The two commands of the README. Both set everything up on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
CORES ?= 2
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: arms test lint install services bytecode

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU build of torch first, so nothing below pulls a CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

# An editable install leaves the project's own modules uncompiled; where
# PYTHONDONTWRITEBYTECODE is set, every stage process would compile them again.
bytecode: install
	$(PY) -m compileall -q align

arms: bytecode
	snakemake --cores $(CORES) arms

# Headless Chromium and the two-node Slurm cluster the suite tests against (root or sudo).
services:
	bash .ci/services_up.sh

# The Slurm tests spend much of their time waiting on the scheduler, so they run beside the
# rest of the suite; their report follows, and either run failing fails the target. After
# them come tests that need no finished default run, to fill the cores the other run's
# single-rank and single-threaded tests leave idle.
BESIDE := tests/test_slurm.py tests/test_trainer_multirank.py tests/test_flash_attn.py \
	tests/test_kernel_gate_rule.py tests/test_generation_sanity.py tests/test_optim.py \
	tests/test_ref_precompute.py tests/test_train_units.py tests/test_probe_peaks.py
test: bytecode services
	@log=$$(mktemp); \
	ALIGN_SERVICES=required $(PY) -m pytest -q $(BESIDE) > $$log 2>&1 & beside=$$!; \
	ALIGN_SERVICES=required $(PY) -m pytest -q $(BESIDE:%=--ignore=%); rest=$$?; \
	wait $$beside; beside_status=$$?; \
	echo "--- $(BESIDE)"; cat $$log; rm -f $$log; \
	exit $$((rest || beside_status))

lint: install
	ruff check . && ruff format --check . && snakefmt --check Snakefile rules && snakemake --lint
