# Two commands for users: `make lab` and `make test`. Both bootstrap .venv first.
PYTHON_BOOT ?= python3
VENV        := .venv
PY          := $(VENV)/bin/python
STAMP       := $(VENV)/.installed
# make lab PROFILE=quick NOTEBOOKS="labs/01_batch_size_sweep.ipynb"
PROFILE     ?=
NOTEBOOKS   ?=
PYTEST_ARGS ?=
# make test runs the suite on TEST_WORKERS pytest-xdist workers, each taking a whole test file at a time
# (module fixtures run once), the longest files first (tests/conftest.py); TEST_WORKERS=0: one process.
# Three on two cores: many slow tests wait (time limits, SLURM's checks, a child's start), and a third
# worker fills those waits (pytest took 740 s with three workers, 840 s with two, on the 2-core CI machine;
# 677 s with three and 695 s with four once OpenMP's threads stopped spinning: tests/conftest.py).
TEST_WORKERS ?= 3
# Which torch build `make venv` installs (tools/cuda_wheels.py; docs/cluster.md): by default the one
# this machine's NVIDIA driver runs (PyPI's without a driver).
#   make venv TORCH_VARIANT=cu126      force a build (cu126, cu130, cu132, cpu, pypi, an index URL;
#                                      it sticks to .venv until TORCH_VARIANT=auto)
#   make venv SYSTEM_TORCH=1           use the torch the interpreter already has (a cluster module):
#                                      .venv with --system-site-packages, no torch installed
TORCH_VARIANT ?=
SYSTEM_TORCH  ?=
USE_SYSTEM    := $(filter 1 yes true,$(SYSTEM_TORCH))

.PHONY: venv lab test prepare kernel lint report clean-results student discussion grade fold sandbox doctor \
	mutants docs

venv: $(STAMP)

# A build asked for on the command line is installed even when .venv is up to date (not one
# set in the environment: jobs on offline nodes must keep finding .venv up to date).
ifneq ($(filter command,$(origin TORCH_VARIANT) $(origin SYSTEM_TORCH)),)
.PHONY: $(STAMP)
endif

$(STAMP): requirements.txt constraints.txt pyproject.toml tools/cuda_wheels.py lab_utils/engine/cuda_builds.py
	@test -x $(PY) || $(PYTHON_BOOT) -m venv $(if $(USE_SYSTEM),--system-site-packages) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) tools/cuda_wheels.py install --python $(PY) --requirements requirements.txt \
		--constraints constraints.txt --variant "$(TORCH_VARIANT)" $(if $(USE_SYSTEM),--system-torch)
	$(PY) -m pip install -q --no-deps -e .
	@# The editable lab_utils is imported from this checkout, where PYTHONDONTWRITEBYTECODE (set on CI and
	@# some clusters' images) keeps Python from caching it: every kernel, worker and rank compiled it again.
	$(PY) -m compileall -qq lab_utils
	@touch $(STAMP)

lab: venv      ## execute every notebook headless, then print where the report is
	$(PY) -m lab_utils run $(NOTEBOOKS) $(if $(PROFILE),--profile $(PROFILE))

test: venv     ## the test suite (CPU, offline)
	@test -d tests || { echo "make test runs the lab's own test suite, which this copy does not hold."; exit 2; }
	$(PY) -m pytest $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) \
		$(PYTEST_ARGS)

# make report                 the hand-in: results/<profile>/handin/{report.md,report.html,handin.json}
# make report CHECK=1         ... and list what is not ready to hand in (make fails if anything is)
CHECK ?=
report: venv   ## write the hand-in from the stored results and your notebooks (README "Handing in")
	$(PY) -m lab_utils report $(if $(PROFILE),--profile $(PROFILE)) $(if $(filter 1 yes true,$(CHECK)),--check)

doctor: venv   ## first session on a GPU node: what no CPU test can check (<= 10 min; docs/instructor.md)
	$(PY) -m lab_utils doctor $(if $(PROFILE),--profile $(PROFILE))

# Plant each bug of tests/gpu_mutants.py, alone, in a scratch copy and run its site's tests; rewrites
# tests/gpu_mutants_results.json and tests/GPU_BRANCHES.md (tens of minutes: not part of make test).
#   make mutants MUTANTS_ARGS="--only comm_hooks"     only some mutants (the others keep their verdicts)
MUTANTS_ARGS ?=
mutants: venv  ## run the GPU path's mutants (tools/mutants.py), niced
	@test -f tools/mutants.py || { echo "make mutants is for the lab's developers: this copy has no tools/mutants.py."; exit 2; }
	nice -n 10 $(PY) tools/mutants.py $(MUTANTS_ARGS)

prepare: venv  ## download CIFAR-10 and the text corpus into data/ (needs internet)
	$(PY) -m lab_utils prepare

kernel: venv   ## register .venv as a Jupyter kernel for JupyterLab
	$(PY) -m ipykernel install --user --name dl-perf-lab --display-name "DL performance lab (.venv)"

# Instructor (docs/grading.md):
#   make student                          student copy -> dist/student/, grading bundle -> dist/grading/
#   make discussion                       the student copy with the discussion -> dist/discussion/ (after
#                                         the deadline)
#   make grade SUBMISSIONS=handed_in      each notebook graded in a bwrap sandbox -> grades/ (gradebook.csv,
#                                         details.csv, feedback/); GRADE_ARGS="--roster students.csv" ...
#   make fold HAND=points.csv             points given by hand -> totals and feedback in grades/
#   make sandbox                          installs bubblewrap (bwrap), which make grade needs (apt-get)
DIST        ?= dist
GRADES      ?= grades
SUBMISSIONS ?=
HAND        ?=
GRADE_ARGS  ?=
SUDO        := $(if $(filter 0,$(shell id -u)),,sudo)
student: venv  ## build the student copy and the grading bundle (otter assign)
	$(PY) -m lab_utils student --out $(DIST)

discussion: venv  ## the student copy with the discussion cells in (dist/discussion/): after the deadline
	$(PY) -m lab_utils student --discussion --out $(DIST)

grade: venv    ## grade a folder (or zip) of handed-in notebooks, each in a sandbox
	@test -n "$(SUBMISSIONS)" || { echo "usage: make grade SUBMISSIONS=folder_or_zip [GRADE_ARGS='--roster students.csv']"; exit 2; }
	$(PY) -m lab_utils grade "$(SUBMISSIONS)" --bundle $(DIST)/grading --out $(GRADES) $(GRADE_ARGS)

fold: venv     ## fold points given by hand (CSV: student, question, points, comment) into the gradebook
	@test -n "$(HAND)" || { echo "usage: make fold HAND=points.csv (start from $(GRADES)/hand_points_template.csv)"; exit 2; }
	$(PY) -m lab_utils fold "$(HAND)" --out $(GRADES)

sandbox:       ## install bubblewrap, the sandbox make grade runs each submission in (Debian/Ubuntu)
	@command -v bwrap >/dev/null && echo "bwrap is installed: $$(bwrap --version)" || \
		{ $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq bubblewrap; }

docs: venv     ## write docs/generated/ (time budget, question map, hand-in) from the code; a test checks it
	$(PY) -m lab_utils docs

lint: venv
	$(VENV)/bin/ruff check .

clean-results:
	rm -rf results/
