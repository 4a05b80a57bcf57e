# Two commands for users: `make lab` and `make test`. Both bootstrap .venv first.
PYTHON_BOOT ?= python3
VENV        := .venv
PY          := $(VENV)/bin/python
STAMP       := $(VENV)/.installed
# make lab PROFILE=quick NOTEBOOKS="labs/01_batch_size_sweep.ipynb"
PROFILE     ?=
NOTEBOOKS   ?=
PYTEST_ARGS ?=

.PHONY: venv lab test prepare kernel lint report clean-results

venv: $(STAMP)

$(STAMP): requirements.txt constraints.txt pyproject.toml
	@test -x $(PY) || $(PYTHON_BOOT) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -c constraints.txt
	$(PY) -m pip install -q --no-deps -e .
	@touch $(STAMP)

lab: venv      ## execute every notebook headless, then print where the report is
	$(PY) -m lab_utils run $(NOTEBOOKS) $(if $(PROFILE),--profile $(PROFILE))

test: venv     ## the test suite (CPU, offline)
	$(PY) -m pytest $(PYTEST_ARGS)

prepare: venv  ## download CIFAR-10 and the text corpus into data/ (needs internet)
	$(PY) -m lab_utils prepare

kernel: venv   ## register .venv as a Jupyter kernel for JupyterLab
	$(PY) -m ipykernel install --user --name dl-perf-lab --display-name "DL performance lab (.venv)"

lint: venv
	$(VENV)/bin/ruff check .

clean-results:
	rm -rf results/
