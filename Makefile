# The two commands of the README. Both set everything up on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
CORES ?= 2
export PATH := $(abspath $(VENV))/bin:$(PATH)

# Each module's bytecode is written by the first process that imports it and read by every
# later one (every rank of every stage imports torch); with PYTHONDONTWRITEBYTECODE set,
# each process would compile its imports again.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: arms rehearsal test lint install services

# Nothing is compiled at install: the first import writes the bytecode of what is used.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# The CPU build of torch first (pip takes it from this machine's disk), so nothing
	# below pulls a CUDA build.
	$(PY) -m pip install --quiet --no-compile torch==2.13.0 uv==0.13.9
	# uv fetches and installs the rest in parallel; the installed torch satisfies the pin.
	$(VENV)/bin/uv pip install --quiet --python $(PY) -e '.[test]'
	touch $@

install: $(VENV)/.installed

arms: install
	snakemake --cores $(CORES) arms

# The scale rehearsal: the whole chain at 60M and at 250M parameters on this machine's CPUs,
# about 47 minutes on two cores (README, "Scale rehearsal"). benchmarks/rehearsal.py keeps the
# inputs it has already written, so a second run reruns nothing that has not changed.
rehearsal: install
	$(PY) benchmarks/rehearsal.py --out rehearsal --sizes 60m 250m
	snakemake --configfile config/rehearsal/60m.yaml --cores $(CORES) arms
	snakemake --configfile config/rehearsal/250m.yaml --cores $(CORES) arms
	$(PY) benchmarks/projections.py rehearsal/60m/results rehearsal/250m/results

# Headless Chromium and the two-node Slurm cluster the suite tests against (root or sudo).
services:
	bash .ci/services_up.sh

# The Slurm tests spend much of their time waiting on the scheduler, so they run beside the
# rest of the suite; their report follows, and either run failing fails the target. After
# them come tests that need no finished default run, to fill the cores the other run's
# single-rank and single-threaded tests leave idle.
BESIDE := tests/test_slurm.py tests/test_trainer_multirank.py tests/test_flash_attn.py \
	tests/test_kernel_gate_rule.py tests/test_generation_sanity.py tests/test_optim.py \
	tests/test_ref_precompute.py tests/test_train_units.py tests/test_probe_peaks.py \
	tests/test_full_disk.py tests/test_trl_trainer_parity.py
# The two runs oversubscribe the cores: OpenMP workers that spin while they wait would burn
# the time the other run's processes need, so they sleep.
test: export OMP_WAIT_POLICY := PASSIVE
# The install and the services' packages are fetched side by side.
test:
	@$(MAKE) --no-print-directory -j2 install services
	@log=$$(mktemp); \
	ALIGN_SERVICES=required $(PY) -m pytest -q $(BESIDE) > $$log 2>&1 & beside=$$!; \
	ALIGN_SERVICES=required $(PY) -m pytest -q $(BESIDE:%=--ignore=%); rest=$$?; \
	wait $$beside; beside_status=$$?; \
	echo "--- $(BESIDE)"; cat $$log; rm -f $$log; \
	exit $$((rest || beside_status))

lint: install
	ruff check . && ruff format --check . && snakefmt --check Snakefile rules && snakemake --lint
