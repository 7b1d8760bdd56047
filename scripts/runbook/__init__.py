"""The hardware runbook (docs/hardware-runbook.md) as one command.

`python3 -m scripts runbook --machine mi300x` runs, on a ROCm machine with a
container engine, the A/B comparison the upstream reviewers asked for: A is
the vLLM ROCm release image (the NVIDIA drafter module runs on ROCm there), B
is the same image with this stack's overlay (`make rocm-image`).

Steps, in order (`steps.STEPS`, their one list: each a function of `steps.py`
taking a `Runbook`, whose executor runs commands, a subprocess in real use and
a recording fake in tests, and a function of `plan.py` that builds the
commands; adding a step is those two functions and one entry there):

0. preflight: the engine answers, both images exist and hold what they should;
1. tests: the stack's vLLM tests in B on the GPUs; ROCm-only tests must run;
2. profile: a few decode steps of B under the torch profiler, once per AITER
   regime (`config.REGIMES`: off; on; on + FP8 BMM; on + FP4 BMM on gfx950),
   kernel names checked against what that regime's switches expect;
3. accuracy: gsm8k through lm-eval against `vllm serve` for the target without
   speculative decoding (the reference), B in every regime and A in the
   sweep's; each must match its regime's reference within noise, and a
   configuration that fails gets no performance numbers;
4. sweep: `vllm bench serve` over output length x concurrency for A and B
   with the speculative config of the original request, and the draft-block
   attention kernel benchmark when the project has one;
5. report: one folder with CSV files, a markdown summary with B/A ratios,
   plots, and the exact commands and versions used.

Results are written as they arrive under the output folder; a second run
skips what already exists, so an interrupted run resumes. `--dry-run` prints
the whole plan and runs nothing.
"""
