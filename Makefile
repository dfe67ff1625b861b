# llmesh: two commands do all the set-up on a fresh machine.
#   make run   - install (CPU build), prepare the default model, start the whole mesh
#   make test  - install with dev tools, then buf lint, ruff, mypy, the Kubernetes manifests
#                (rendered by kubectl kustomize, validated strictly) and the whole pytest suite

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
CONFIG ?=
PYTEST_ARGS ?=

.PHONY: run test install install-dev protos model lint typecheck buf-lint manifests pytest clean help

help:
	@echo "make run    start the mesh on the default model (installs what is missing)"
	@echo "make test   buf lint, ruff, mypy, Kubernetes manifests and the whole pytest suite"
	@echo "make manifests  render every deploy/k8s kustomization (kubectl) and validate it"
	@echo "make protos regenerate gRPC stubs from protos/"

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# Text serving needs neither torchvision, torchaudio nor torchcodec, and PyPI's
# torchvision fails to load beside the CPU torch build (breaking transformers imports).
define drop_torch_extras
	$(PIP) uninstall --yes --quiet torchvision torchaudio torchcodec 2>/dev/null || true
endef

$(VENV)/.installed-cpu: pyproject.toml setup.py | $(PY)
	$(PIP) install --quiet -e ".[cpu]"
	$(call drop_torch_extras)
	touch $@

$(VENV)/.installed-dev: pyproject.toml setup.py | $(PY)
	$(PIP) install --quiet -e ".[cpu,dev]"
	$(call drop_torch_extras)
	touch $@ $(VENV)/.installed-cpu

install: $(VENV)/.installed-cpu protos
install-dev: $(VENV)/.installed-dev protos

protos: | $(PY)
	$(PY) scripts/genprotos.py >/dev/null

model: install
	$(VENV)/bin/llmesh model prepare

run: model
	$(VENV)/bin/llmesh up $(if $(CONFIG),--config $(CONFIG))

buf-lint: install-dev
	$(VENV)/bin/buf lint

lint: install-dev
	$(VENV)/bin/ruff check .

typecheck: install-dev
	$(VENV)/bin/mypy

# Every kustomization under deploy/k8s rendered by the real kustomize (kubectl's) and
# every object validated strictly (CRD kinds against deploy/k8s/schemas/), then the
# manifests checked against the tiers' code. Needs kubectl (README, Development).
manifests: install-dev
	$(PY) -m deploy.tools.validate
	$(PY) -m deploy.tools.consistency

pytest: install-dev
	$(VENV)/bin/llmesh model prepare --quiet
	$(VENV)/bin/llmesh model prepare tiny-deepseek --quiet
	# The venv's bin on PATH: tests run the real grpcurl and buf installed there.
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest $(PYTEST_ARGS)

test: buf-lint lint typecheck manifests pytest

clean:
	rm -rf $(VENV) build dist *.egg-info llmesh/v1 llmesh/common llmesh/worker llmesh/router \
		llmesh/tokenizer llmesh/postprocess
