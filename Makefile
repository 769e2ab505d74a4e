# Two entry points for a fresh machine with Python 3.11:
#   make run    the main job (the local dry-run on its embedded default scenario)
#   make test   the whole test suite
#   make lint   ruff, mypy on the product parts, the import contracts (docs/developing.md)
# Both create .venv and install what they need, with torch pinned by constraints.txt.
PYTHON ?= python3
VENV   ?= .venv
PIP    := $(VENV)/bin/pip
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.spotguard-installed

# Some machines set PYTHONDONTWRITEBYTECODE=1 (this project's CI kind does). Every process then
# compiles the repository's modules from source (~0.25 s of CPU per trainer start) and pytest
# rewrites every test module again in each xdist worker; the suite and the dry-run start hundreds
# of processes. Here they cache bytecode in __pycache__ (ignored by git): an empty value is unset
# for Python.
export PYTHONDONTWRITEBYTECODE :=

.PHONY: run test lint test-k8s k8s-assets promtool bench install clean

# A real control plane for the tests marked k8s: the bundle in ../shared, unpacked once.
# `make test` runs them when KUBEBUILDER_ASSETS is set (as .ci/run and test-k8s do), else skips them.
K8S_BUNDLE ?= ../shared/tools/kube-control-plane/kube-control-plane-v1.36.2.tar.xz
K8S_ROOT   := .cache/kube-control-plane-v1.36.2
K8S_ASSETS := $(K8S_ROOT)/k8s-rig/bin

install: $(STAMP)

# The install prints one line; pip's and the build backends' output (the commands included) goes to
# INSTALL_LOG, whose last lines are printed, with its path, if a step fails (the steps are joined
# with && : `set -e` does not apply inside the left side of ||).
INSTALL_LOG := $(VENV)/install.log
INSTALL_TAIL := 40
# DeepSpeed's CPU ops compile (tools/prebuild_deepspeed_op.py: needs torch and DeepSpeed only) while
# pip installs the rest: the compile is the longest step of the install.
PREBUILD_LOG := $(VENV)/prebuild.log

$(STAMP): pyproject.toml setup.py constraints.txt
	@echo "installing spotguard and its dependencies into $(VENV) (about 2 minutes on a quiet machine; log: $(INSTALL_LOG))"
	@$(PYTHON) -m venv $(VENV)
	@( set -x; \
	  $(PIP) install -q --upgrade pip setuptools wheel && \
	  $(PIP) install -q -c constraints.txt torch==2.13.0 && \
	  DS_BUILD_OPS=0 $(PIP) install -q -c constraints.txt --no-build-isolation deepspeed && \
	  { TORCH_EXTENSIONS_DIR=$(abspath .cache/torch_extensions) $(PY) tools/prebuild_deepspeed_op.py \
	      > $(PREBUILD_LOG) 2>&1 & prebuild=$$!; \
	    $(PIP) install -q -c constraints.txt -e '.[train,deepspeed,hf,lightning,k8s,gpu,ui,s3,test,lint]'; \
	    installed=$$?; wait $$prebuild; built=$$?; cat $(PREBUILD_LOG); \
	    [ $$installed -eq 0 ] && [ $$built -eq 0 ]; } \
	) > $(INSTALL_LOG) 2>&1 || { tail -n $(INSTALL_TAIL) $(INSTALL_LOG) >&2; \
	  echo "make install: failed (above: the last $(INSTALL_TAIL) lines of $(INSTALL_LOG))" >&2; exit 1; }
	@touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/spotguard dry-run

# The suite runs on PYTEST_WORKERS processes (pytest-xdist; 0 runs it in this process): most of a
# multi-process or dry-run test's time is spent waiting (start-up, rendezvous, simulated steps), so
# even on two cores more workers than cores pay. A fourth did not while every rank imported torch
# itself (~1570 s of CPU: 1053 s against 1014 s of pytest); with the tests' ranks forked from a
# preloaded Python (tests/workers/zygote.py) it does: 761 s of pytest on 4 workers, against about
# 14 minutes on 3 (docs/developing.md, "The suite's time"). Every test tolerates a neighbour.
PYTEST_WORKERS ?= 4

test: $(STAMP)
	@$(PY) -m pytest -n $(PYTEST_WORKERS) --dist worksteal $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing on purpose" >&2; exit 1; fi; \
	exit $$rc

# mypy and import-linter read packages from the filesystem and cannot follow setup.py's folder
# mapping: they run inside the symlink tree tools/package_tree.py builds, with that tree as the
# current directory (import-linter puts the cwd first on sys.path, ahead of the editable install).
TREE := .cache/package-tree
SIZE_CHECKED := spotguard agent hooks supervisor injector integrations trainer emulator  # classes <= 300 lines, functions <= 80
PRODUCT_PARTS := spotguard.wire spotguard.kube spotguard.data spotguard.agent spotguard.hooks spotguard.supervisor spotguard.injector
SHARED_MODULES := spotguard.config spotguard.daemon spotguard.http_server spotguard.metrics spotguard.backoff \
                  spotguard.logs spotguard.processes spotguard.safe_json spotguard.stream_slots

# All three run, so one CI log shows every finding; the target fails if any of them failed.
lint: $(STAMP)
	@$(PY) tools/package_tree.py $(TREE) >/dev/null
	@rc=0; \
	echo "== ruff"; $(VENV)/bin/ruff check . || rc=1; \
	echo "== mypy"; (cd $(TREE) && $(abspath $(VENV))/bin/mypy --config-file $(abspath pyproject.toml) \
		$(addprefix -p ,$(PRODUCT_PARTS)) $(addprefix -m ,$(SHARED_MODULES))) || rc=1; \
	echo "== import contracts"; (cd $(TREE) && $(abspath $(VENV))/bin/lint-imports \
		--config $(abspath pyproject.toml)) || rc=1; \
	echo "== code size"; $(PY) tools/code_size.py $(SIZE_CHECKED) || rc=1; \
	exit $$rc

k8s-assets: $(K8S_ASSETS)/kube-apiserver

$(K8S_ASSETS)/kube-apiserver: $(K8S_BUNDLE)
	mkdir -p $(K8S_ROOT)
	tar -xJf $(K8S_BUNDLE) -C $(K8S_ROOT) && touch $@

test-k8s: $(STAMP) k8s-assets
	@KUBEBUILDER_ASSETS=$(abspath $(K8S_ASSETS)) $(PY) -m pytest -m k8s $(PYTEST_ARGS)

# promtool for the alert rules' tests (tests/test_prometheus_rules.py): Debian's `prometheus`
# package, fetched with `apt-get download` and unpacked with `dpkg -x` into .cache (no root; root
# only refreshes empty package lists with `apt-get update`).
PROMTOOL_ROOT := .cache/prometheus
PROMTOOL      := $(PROMTOOL_ROOT)/usr/bin/promtool

promtool: $(PROMTOOL)

$(PROMTOOL):
	rm -rf $(PROMTOOL_ROOT) && mkdir -p $(PROMTOOL_ROOT)/deb
	cd $(PROMTOOL_ROOT)/deb && { apt-get download -q prometheus \
		|| { [ "$$(id -u)" = 0 ] && apt-get update -qq && apt-get download -q prometheus; }; }
	dpkg -x $(PROMTOOL_ROOT)/deb/prometheus_*.deb $(PROMTOOL_ROOT)
	rm -rf $(PROMTOOL_ROOT)/deb $(PROMTOOL_ROOT)/usr/bin/prometheus $(PROMTOOL_ROOT)/usr/share
	$(PROMTOOL) --version >/dev/null && touch $@

bench: $(STAMP)
	$(VENV)/bin/spotguard bench all

clean:
	rm -rf $(VENV) build *.egg-info .cache
