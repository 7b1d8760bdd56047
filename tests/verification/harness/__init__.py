"""Verification harness: the K3 DSpark drafters running for real on CPU.

Only GPU kernels are replaced (by plain-torch reference kernels in
``reference.py``, registered as the CPU bodies of vLLM's compiled ops in
``ops.py``). Platform emulation lives in ``platform.py`` and must be applied
before vLLM is imported; tests reach an emulated process through ``zygote.py``.
``interpreter.py`` runs vLLM's own Triton kernels in Triton's interpreter, in spawned workers.
"""
