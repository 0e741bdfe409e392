# Two commands on a fresh Linux machine with Python 3.11+: `make demo`, `make test`.
# Each creates .venv and installs what it needs on first use.

PYTHON ?= python3
VENV   := .venv
STAMP  := $(VENV)/.installed

.PHONY: demo test bench proto clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' \
	  || { echo "extproc needs Python 3.11 or newer (PYTHON=$(PYTHON))"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/extproc demo

test: $(STAMP)
	@./tools/system-packages.sh
	$(VENV)/bin/python -m pytest

bench: $(STAMP)
	$(VENV)/bin/extproc bench overhead

# The admin API's Python modules, generated from proto/ (tests/test_admin.py checks they are in step).
proto: $(STAMP)
	$(VENV)/bin/python -m grpc_tools.protoc -I proto --python_out=. --grpc_python_out=. --pyi_out=. \
	  proto/extproc/admin/v1/admin.proto

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
