# Front door of the K3 DSpark ROCm patch stack. The logic lives in scripts/
# (python3 -m scripts <command>); see README.md.

PYTHON ?= python3
STACK  := $(PYTHON) -m scripts

.PHONY: help apply patches rebase drift overlay install-overlay build test check bench lock clean fetch \
        rocm-image rocm-source-image

help:
	@echo "make apply      fetch pinned vLLM, apply patches/series -> build/vllm, vllm_overlay/"
	@echo "make test       build .venv (if needed) and run every test suite"
	@echo "make check      fast self-check of the stack (no venv)"
	@echo "make patches    export build/vllm's commits back to patches/ (maintainers)"
	@echo "make rebase VLLM_VERSION=x.y.z   move the stack to another vLLM release"
	@echo "make drift [VLLM_VERSION=x.y.z]  try the stack on the newest release (changes nothing)"
	@echo "make install-overlay TARGET=dir  copy vllm_overlay/ onto an installed vLLM"
	@echo "make bench      time apply/check/patches against their goals (prints figures)"
	@echo "make rocm-image [BASE_IMAGE=...] [IMAGE_TAG=...]   ROCm image: release image + overlay"
	@echo "make rocm-source-image [BASE_IMAGE=...] [DOCKER_TARGET=final|test]  ROCm image: vLLM's Dockerfile.rocm on build/vllm"
	@echo "make build | lock | fetch | clean"

apply:
	$(STACK) apply

patches:
	$(STACK) patches

rebase:
	@test -n "$(VLLM_VERSION)" || { echo "usage: make rebase VLLM_VERSION=x.y.z"; exit 2; }
	$(STACK) rebase $(VLLM_VERSION)

drift:
	$(STACK) drift $(VLLM_VERSION)

overlay:
	$(STACK) overlay

install-overlay:
	@test -n "$(TARGET)" || { echo "usage: make install-overlay TARGET=<folder containing vllm/>"; exit 2; }
	$(STACK) install-overlay $(TARGET)

build: apply
	$(STACK) build

test: build
	$(STACK) test

check:
	$(STACK) check

bench:
	$(STACK) bench

lock:
	$(STACK) lock

fetch:
	$(STACK) fetch

clean:
	$(STACK) clean

# BASE_IMAGE, IMAGE_TAG, SMOKE_GCN_ARCH and DOCKER_TARGET reach the script through the
# environment (make exports command-line variables), never through the shell.
rocm-image:
	$(STACK) rocm-image

rocm-source-image:
	$(STACK) rocm-image --source
