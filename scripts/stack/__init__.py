"""The patch stack itself: the pin and its downloads, build/vllm's git repository, the
series, applying and exporting it (`make apply`, `make patches`, `make export`), rebase,
drift, vllm_overlay/, `make check` and `make clean`, the two venvs and their locks, and
vLLM's pre-commit linters run on the files the stack changes."""
