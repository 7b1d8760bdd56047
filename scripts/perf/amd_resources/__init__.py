"""What the stack's Triton kernels need of an AMD GPU, compiled on CPU.

Triton's AMD backend lowers a kernel to AMDGCN without a GPU. This package
loads the kernel files of the patched tree (build/vllm, as it is on disk)
under a ROCm platform stand-in, calls their real wrappers at the K3 DSpark
drafter's production shapes with a launcher that records each launch instead
of running it, and compiles every recorded launch the way Triton's JIT would
on an MI300 (gfx942) or MI355 (gfx950): same specialization, constexprs and
launch options. From the compiled kernel it reads the LDS, registers,
scratch and spills, and from those the waves each SIMD can hold.

Run with the project's .venv (Triton with its AMD backend):

    .venv/bin/python -m scripts.perf.amd_resources            # table; exit 1 on a violation
    .venv/bin/python -m scripts.perf.amd_resources --sweep    # tile study of the block kernel

`make bench` prints the table; tests/verification/test_amd_resources.py fails
`make test` when a kernel does not compile, needs more LDS than a CU has, or
spills to scratch. Compiled kernels are kept in build/amd-resources/ (Triton's
cache, keyed by the kernel source, specialization and options).
"""
