"""Run vLLM's own pytest files under vLLM's real RocmPlatform, emulated on CPU.

See ``plugin.py``. The plugin runs with the vLLM tree as the working
directory, where ``tests`` is vLLM's test package, so this directory and the
verification harness are imported from ``<project>/tests`` as top-level
packages (``rocm_emulation``, ``verification``).
"""
