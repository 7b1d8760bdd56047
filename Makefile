# Front door of the K3 DSpark ROCm patch stack. The logic lives in scripts/
# (python3 -m scripts <command>); see README.md.

# Every variable given on the command line (TARGET, VLLM_VERSION, FRESH,
# FORCE, SIGNOFF, the image variables, any other) is data, never code: taken
# literally ($(value): make expands nothing in it; make would otherwise expand
# each one whenever it exports it to a recipe) and still exported as given.
# The scripts get them through the environment and quote them (the shell runs
# nothing in them). FORCE counts only when typed on make's own command line:
# `clean` asks the script to check that (MAKEFLAGS looks the same to make).
$(foreach v,$(.VARIABLES),$(if $(filter command line,$(origin $(v))),\
  $(eval override $(v) := $$(value $(v)))$(eval export $(v))))
export TARGET VLLM_VERSION BASE_IMAGE IMAGE_TAG SMOKE_GCN_ARCH DOCKER_TARGET

PYTHON ?= python3
STACK  := $(PYTHON) -m scripts

.PHONY: help apply patches rebase rebase-abandon drift overlay install-overlay build test check bench \
        gpubench gpu-tables lock clean fetch export rocm-image rocm-source-image

# SIGNOFF reaches Python verbatim through the environment: unexpanded by make
# (`unexport`, $(value)) and single-quoted for the shell, a newline as the two
# characters \n, which the export refuses.
unexport SIGNOFF
define newline


endef
shell_quote = '$(subst $(newline),\n,$(subst ','\'',$(1)))'

help:
	@echo "make apply      fetch pinned vLLM, apply patches/series -> build/vllm, vllm_overlay/"
	@echo "make test       build .venv (if needed) and run every test suite"
	@echo "                (reuses what passed before on the same inputs; FRESH=1 runs it all;"
	@echo "                ONLY=\"prefix 3/7,stack\" runs only those rows)"
	@echo "make check      fast self-check of the stack (no venv)"
	@echo "make patches    export build/vllm's commits back to patches/ (maintainers)"
	@echo "make rebase VLLM_VERSION=x.y.z   move the stack to another vLLM release"
	@echo "make rebase-abandon  give up a rebase that stopped (its work kept as a branch)"
	@echo "make drift [VLLM_VERSION=x.y.z]  try the stack on the newest release (changes nothing)"
	@echo "make overlay    regenerate vllm_overlay/ from build/vllm (make apply does it too)"
	@echo "make install-overlay TARGET=dir  copy vllm_overlay/ onto an installed vLLM"
	@echo "make bench      time apply/check/patches against their goals (prints figures)"
	@echo "make gpubench   time the stack's GPU kernels against the release (needs a GPU to run)"
	@echo "make gpu-tables rewrite BENCHMARKS.md's GPU tables from their logs (make check compares)"
	@echo "make rocm-image [BASE_IMAGE=...] [IMAGE_TAG=...]   ROCm image: release image + overlay"
	@echo "make rocm-source-image [BASE_IMAGE=...] [DOCKER_TARGET=final|test]  ROCm image: vLLM's Dockerfile.rocm on build/vllm"
	@echo "make clean [FORCE=1]  remove build/ and the venvs (FORCE=1: also work only build/vllm holds)"
	@echo "make export SIGNOFF=\"Name <email>\"  one folder per patch for upstream -> build/export/"
	@echo "make build | lock | fetch"

apply:
	$(STACK) apply

patches:
	$(STACK) patches

rebase-abandon:
	$(STACK) rebase --abandon

rebase:
	@test -n "$$VLLM_VERSION" || { echo "usage: make rebase VLLM_VERSION=x.y.z"; exit 2; }
	$(STACK) rebase -- "$$VLLM_VERSION"

drift:
	$(STACK) drift -- "$$VLLM_VERSION"

overlay:
	$(STACK) overlay

install-overlay:
	@test -n "$$TARGET" || { echo "usage: make install-overlay TARGET=<folder containing vllm/>"; exit 2; }
	$(STACK) install-overlay -- "$$TARGET"

build: apply
	$(STACK) build

test: build
	$(STACK) test $(if $(filter 1 yes true,$(value FRESH)),--fresh) --only "$$ONLY"

export:
	@K3_SIGNOFF=$(call shell_quote,$(value SIGNOFF)) $(STACK) export

check:
	$(STACK) check

bench:
	$(STACK) bench

gpubench:
	$(STACK) gpubench

gpu-tables:
	$(STACK) gpu-tables

lock:
	$(STACK) lock

fetch:
	$(STACK) fetch

clean:
	$(STACK) clean $(if $(filter 1,$(value FORCE)),--forced-by-make=$$PPID)

# BASE_IMAGE, IMAGE_TAG, SMOKE_GCN_ARCH and DOCKER_TARGET reach the script through the
# environment (exported above), never through the shell.
rocm-image:
	$(STACK) rocm-image

rocm-source-image:
	$(STACK) rocm-image --source
