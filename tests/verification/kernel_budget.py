"""Kernel budget of one K3 DSpark draft step, counted on CPU.

Counts the device kernels one draft step launches, per phase, with the
dispatch-level counter of ``harness/launches.py`` (its docstring states the
counting rules), for:

* ``baseline``: the NVIDIA module of pristine vLLM 0.34.0 on ROCm, which is
  what ROCm users run today (0.34.0's registry sends ``K3DSparkModel`` to
  ``nvidia.dspark_mla`` on every platform). It runs in a zygote that imports
  the whole pristine release, extracted from git (``tests.support.pristine``);
* ``nvidia`` and ``amd``: the patched NVIDIA and AMD modules on ROCm (the
  NVIDIA module on the patched tree is what ROCm would run with the stack
  but without its ROCm drafter and dispatch patches: the fair comparison);
* ``amd-aiter-gfx942`` (MI300) and ``amd-aiter-gfx950`` (MI355): the AMD
  module in the AITER FP8 BMM regime (``VLLM_ROCM_USE_AITER=1`` with FP8 BMM on
  the platform's fp8, ``harness/aiter_drafter.py``), each in an AITER-on zygote
  of its arch: aiter's Triton kernels count as ``triton::`` launches, its HIP
  op ``_fused_qk_rmsnorm`` (a checked double here) as one ``aiter::`` launch.
  ``nvidia-aiter-gfx942`` / ``-gfx950``: the patched NVIDIA module in the same
  zygotes. MI355's FP4 BMM is not counted: the pinned aiter lacks its kernel;

each with a bf16 (``auto``) and an fp8 KV cache, and under both of vLLM's
execution modes: ``compiled`` is vLLM's default config (torch.compile with
Inductor, whose config turns ``CustomOp``s such as RoPE to ``forward_native``,
vLLM IR ops such as RMSNorm to their ``native`` impl, and compiles
``SiluAndMul`` on its own), ``eager`` is ``--enforce-eager`` (custom ops on,
IR ops on vLLM's C++ kernels). The drafter itself is not compiled in either
mode. It is built and run as DSpark does: where the tree has them (the
stack's ``[Perf][Spec Decode]`` patch) and the drafter opts in (the ROCm one
does, the NVIDIA module does not), with ``draft_compilation_config`` and
under ``draft_ir_op_priority`` (``vllm/v1/worker/gpu/spec_decode/dspark/``),
which give the draft the eager kernels in both modes; 0.34.0 has neither.

Phases, each counted in steady state (run once uncounted first, so one-time
work such as uploading the cache-pointer array is left out):

* ``context_kv``: ``precompute_and_store_context_kv`` (once per step);
* ``first_layer`` / ``layer``: the first draft decoder layer, and each further
  one (the first normalises the embedding without a residual add);
* ``model``: what the model's forward launches outside its layers (embedding
  lookup, final norm).

A step with L layers launches ``context_kv + first_layer + (L-1) * layer +
model``. What is counted, and where the count stops:

* the attention layer is run for real up to and including its call into the
  attention backend, plus its KV-cache write (``concat_and_cache_mla_rope_fused``
  on AMD, the fused decode epilogue on NVIDIA). Both sides use TRITON_MLA; its
  attention kernel (``decode_attention_fwd``, or in a patched tree the
  non-causal block kernel ``decode_attention_fwd_mla_block``; two Triton
  kernels each) is replaced by a stand-in counted as one launch,
  ``attention::triton_mla_decode``, on both sides. The backend's own
  preparation (output buffers, 0.34.0's per-row block table and lengths) is
  counted on both sides;
* a Triton kernel launched by the drafter counts once per launch, as
  ``triton::<kernel>`` (the launch is recorded, the kernel not run);
* a function vLLM compiles on its own (``CustomOp.maybe_compile``) counts
  once, as ``compiled::<op>.<method>``: Inductor turns these small pointwise
  graphs into one kernel;
* the attention metadata is built by the model runner and is not counted.

The draft is synthetic and tiny (``harness/drafter.py``; YaRN RoPE, the
configuration the review measured); the counts do not depend on sizes. Only GPU kernels are
replaced (reference bodies in ``harness/ops.py``); everything else is vLLM's
own code under the emulated platform (``harness/platform.py``).

``.venv/bin/python -m tests.verification.kernel_budget`` prints the table (markdown);
``--print-pins`` prints the ``PINS`` literal of ``test_kernel_budget.py``;
``--prefixes`` prints what each platform's drafter launches with the release
and with each prefix of build/vllm's stack (``test_kernel_budget_of_each_prefix.py``
checks each prefix against the release in ``make test``'s prefix rows).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import subprocess
import sys
import tempfile
import types
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tests.support.pristine import base_tag, extract_pristine_package, pristine_git_dir
from tests.verification.harness.aiter_drafter import ARCHES, FP8_DTYPES
from tests.verification.harness.zygote import Zygote

PHASES = ("context_kv", "first_layer", "layer", "model")
PHASE_TITLES = {
    "context_kv": "context KV",
    "first_layer": "first layer",
    "layer": "each further layer",
    "model": "model (embed, final norm)",
}
NUM_LAYERS = 2
CACHE_DTYPES = {"bf16": "auto", "fp8": "fp8"}
ROPE = "yarn"
CONTEXT_TOKENS = 10
BLOCK_TOKENS = 4
ROCM = "rocm-gfx942"
# The AMD module with VLLM_ROCM_USE_AITER=1 and FP8 BMM, per arch of the
# regime (the harness's ARCHES, as test_aiter_drafter.py runs it): measured in
# an AITER-on zygote of the arch (aiter_zygotes), where an aiter op counts as
# one launch. They are compared with the baseline and AITER-off rows, which
# are measured on gfx942 only.
AITER_MODULES = {arch: f"amd-aiter-{arch}" for arch in ARCHES}
# The patched NVIDIA module in the same AITER-on zygotes: what the AITER rows
# are compared with.
NVIDIA_AITER_MODULES = {arch: f"nvidia-aiter-{arch}" for arch in ARCHES}

# aiter's FP8 batched GEMM (vLLM's rocm_aiter_ops.triton_fp8_bmm), as counted.
AITER_FP8_BMM = "triton::_batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant_kernel"

# vLLM's fused RoPE + MLA cache write (csrc/cache_kernels_fused.cu), as counted.
ROPE_AND_CACHE = "_C_cache_ops::concat_and_cache_mla_rope_fused"

# Why the AMD module launches more than the baseline, by cause ...
EXTRA_CAUSES = {
    "q/kv norms": "with VLLM_ROCM_USE_AITER=1 the ROCm wrapper runs q_a_layernorm "
    "and kv_a_layernorm as one AITER kernel (fused_mla_dual_rms_norm, aiter's "
    "_fused_qk_rmsnorm: the AITER rows) where the baseline runs one Triton "
    "kernel (fused_q_kv_rmsnorm, which the AMD module runs with AITER off)",
    "aiter bmm": "with AITER FP8 BMM on, the two absorb BMMs (W_K, W_V) are aiter's "
    "Triton FP8 batched GEMM instead of aten::bmm",
    "rope and cache write": "the RoPE of q_pe and k_pe and the KV-cache write "
    "are one launch of vLLM's concat_and_cache_mla_rope_fused; the baseline's "
    "fused decode epilogue does both together with the query concat",
    "vllm kernels": "in vLLM's default (compiled) config the draft runs vLLM's "
    "kernels (draft_compilation_config, draft_ir_op_priority) where the "
    "baseline runs each op's native PyTorch form, op by op: one kernel "
    "instead of 5-8",
}
# ... and by op: every op the AMD module launches more often than the
# baseline, in any configuration and phase, must be listed with its causes.
ALLOWED_EXTRA: dict[str, tuple[str, ...]] = {
    "_C::rms_norm": ("vllm kernels",),
    "aiter::_fused_qk_rmsnorm": ("q/kv norms",),
    AITER_FP8_BMM: ("aiter bmm",),
    ROPE_AND_CACHE: ("rope and cache write",),
    "_C::fused_add_rms_norm": ("vllm kernels",),
    "_C::silu_and_mul": ("vllm kernels",),
}


@dataclass(frozen=True)
class Config:
    # "baseline" (0.34.0's NVIDIA module), "nvidia", "amd", one of
    # AITER_MODULES (the AMD module in an arch's AITER FP8 BMM regime), or
    # "registry": the class vLLM's registry gives ``K3DSparkModel`` on ROCm,
    # which is what ROCm users run with the tree (0.34.0: the NVIDIA module).
    module: str
    cache: str  # "bf16" or "fp8"
    mode: str  # "compiled" or "eager"

    @property
    def id(self) -> str:
        return f"{self.module}/{self.cache}/{self.mode}"

    @property
    def aiter_arch(self) -> str | None:
        """The emulated arch of an AITER configuration, else None."""
        for modules in AITER_MODULES, NVIDIA_AITER_MODULES:
            for arch, module in modules.items():
                if module == self.module:
                    return arch
        return None

    @property
    def label(self) -> str:
        if self.module == "baseline":
            return f"baseline: NVIDIA module of {base_tag()}"
        if self.module == "registry":
            return "what ROCm runs (the registry's K3DSparkModel)"
        if self.aiter_arch:
            platform = "AMD" if self.module.startswith("amd") else "NVIDIA"
            return f"{platform} module, patched, AITER FP8 BMM, {self.aiter_arch}"
        return f"{self.module.upper()} module, patched"

    @property
    def baseline(self) -> Config:
        return Config("baseline", self.cache, self.mode)

    @property
    def nvidia(self) -> Config:
        """The patched NVIDIA module in this configuration's regime."""
        arch = self.aiter_arch
        module = NVIDIA_AITER_MODULES[arch] if arch else "nvidia"
        return Config(module, self.cache, self.mode)


def configs(*modules: str) -> list[Config]:
    return [
        Config(module, cache, mode)
        for module in modules
        for cache in CACHE_DTYPES
        for mode in ("compiled", "eager")
    ]


CONFIGS = configs(
    "baseline",
    "nvidia",
    "amd",
    *AITER_MODULES.values(),
    *NVIDIA_AITER_MODULES.values(),
)
# What each platform runs with a tree of the stack (any prefix), both counted
# under the emulated ROCm platform: NVIDIA the NVIDIA module, ROCm what the
# registry resolves there.
PLATFORM_MODULES = {"NVIDIA": "nvidia", "ROCm": "registry"}
TREE_CONFIGS = configs(*PLATFORM_MODULES.values())


# --------------------------------------------------------------------------
# Measurement (runs in a forked child of an emulated zygote)
# --------------------------------------------------------------------------


ATTENTION = "attention::triton_mla_decode"


def _kernel_name(kernel) -> str:
    fn = kernel
    while not isinstance(fn, types.FunctionType) and hasattr(fn, "fn"):
        fn = fn.fn  # through Autotuner / Heuristics to the JIT function
    return getattr(fn, "__qualname__", type(kernel).__name__)


def _install_stand_ins() -> None:
    """Count the launches that do not reach the dispatcher. The child is
    thrown away after the measurement, so nothing is restored."""
    import functools

    import triton.runtime.jit as triton_jit

    import vllm.v1.attention.backends.mla.triton_mla as triton_mla
    from vllm.model_executor.custom_op import CustomOp

    from tests.verification.harness.launches import opaque_launch

    def launcher(kernel, grid):
        def launch(*args, **kwargs):
            with opaque_launch(f"triton::{_kernel_name(kernel)}"):
                pass

        return launch

    triton_jit.KernelInterface.__getitem__ = launcher

    def triton_mla_decode(*args, **kwargs):
        with opaque_launch(ATTENTION):
            pass

    # The flat kernel, and (in trees that have it) the non-causal block kernel.
    triton_mla.decode_attention_fwd = triton_mla_decode
    triton_mla.decode_attention_fwd_mla_block = triton_mla_decode

    maybe_compile = CustomOp.maybe_compile

    def counted_compile(self, fn, *, enable=True):
        if maybe_compile(self, fn, enable=enable) is fn:
            return fn  # not compiled: runs (and is counted) op by op
        name = f"compiled::{type(self).__name__}.{fn.__name__}"

        @functools.wraps(fn)
        def compiled(*args, **kwargs):
            with opaque_launch(name):
                return fn(*args, **kwargs)

        return compiled

    CustomOp.maybe_compile = counted_compile


def _dspark_draft_kernels(cls):
    """The tree's dspark.utils if it gives the drafter `cls` the draft's
    kernels (the stack's patch, for an uncompiled drafter), else None
    (0.34.0, or a drafter the loader leaves on the target's config)."""
    try:
        from vllm.v1.worker.gpu.spec_decode.dspark import utils
    except ImportError:
        return None
    if not hasattr(utils, "draft_ir_op_priority"):
        return None
    return utils if utils.draft_runs_uncompiled(cls) else None


def _build(module: str, cache: str, mode: str):
    """The draft as a worker would run it, with bound caches and embedding."""
    import vllm.ir
    from vllm.config import get_cached_compilation_config
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        VocabParallelEmbedding,
    )

    from tests.verification.harness import drafter as D

    # Custom-op dispatch reads a cached compilation config: the zygote's.
    get_cached_compilation_config.cache_clear()
    if module == "registry":
        cls = D.drafter_class()
    else:
        cls = D.drafter_cls("amd" if module.startswith("amd") else "nvidia")
    dspark = _dspark_draft_kernels(cls)
    draft = D.build(
        rope=ROPE,
        cache_dtype=CACHE_DTYPES[cache],
        cls=cls,
        eager=mode == "eager",
        num_layers=NUM_LAYERS,
        # What load_dspark_model builds the draft with.
        draft_compilation=dspark.draft_compilation_config if dspark else None,
    )
    D.allocate_caches(draft)
    config = draft.vllm_config
    # What every worker does at start-up (v1/worker/worker_base.py).
    config.kernel_config.ir_op_priority.set_default()
    vllm.ir.set_default_torch_wrap(config.compilation_config.ir_enable_torch_wrap)
    cfg = draft.hf_config
    with D.config_context(config):
        # The target's embedding, which the runner aliases into the draft.
        embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
    embed.weight.data.normal_()
    draft.model.model.embed_tokens = embed
    return draft


def _attribute_layers(counter, layers) -> None:
    """Count what each decoder layer launches under its phase."""
    for i, layer in enumerate(layers):
        phase = "first_layer" if i == 0 else "layer"
        layer.register_forward_pre_hook(
            lambda *_, phase=phase: setattr(counter, "phase", phase)
        )
        layer.register_forward_hook(lambda *_: setattr(counter, "phase", "model"))


def measure(module: str, cache: str, mode: str) -> dict:
    """Counts, calling sites and setup of one configuration, per phase."""
    import torch

    import vllm
    from vllm.forward_context import set_forward_context

    from tests.verification.harness import drafter as D
    from tests.verification.harness.launches import LaunchCounter

    _install_stand_ins()
    draft = _build(module, cache, mode)
    config = draft.vllm_config
    # What DSparkSpeculator runs the draft under (propose, capture).
    dspark = _dspark_draft_kernels(type(draft.model))
    priority = (
        dspark.draft_ir_op_priority(config).set_priority()
        if dspark
        else contextlib.nullcontext()
    )
    states, positions = D.context_inputs(draft.hf_config, CONTEXT_TOKENS)
    context_slots = D.distinct_slots(CONTEXT_TOKENS, 96, 3)
    seq_len = CONTEXT_TOKENS + BLOCK_TOKENS
    block_ids = torch.arange(BLOCK_TOKENS)
    block_positions = torch.arange(CONTEXT_TOKENS, seq_len)
    block_slots = torch.arange(CONTEXT_TOKENS, seq_len, dtype=torch.int64)
    names = [owner.layer_name for owner in draft.cache_layers()]
    absorb = draft.cache_layers()[0]

    counter = LaunchCounter(sites_under=str(Path(vllm.__file__).parent) + "/")
    _attribute_layers(counter, draft.layers)
    steps = {
        "context_kv": lambda: draft.model.precompute_and_store_context_kv(
            states, positions, context_slots
        ),
        "model": lambda: draft.model(block_ids, block_positions),
    }
    with (
        D.config_context(config),
        priority,
        set_forward_context(
            {name: D.decode_metadata(BLOCK_TOKENS, seq_len) for name in names},
            config,
            slot_mapping={name: block_slots for name in names},
        ),
        torch.inference_mode(),
    ):
        for phase, step in steps.items():
            step()  # steady state: one-time work happens here, uncounted
            counter.phase = phase
            with counter:
                step()
        rms_norm = ",".join(vllm.ir.ops.rms_norm.get_priority())
    return {
        "counts": {p: dict(counter.counts.get(p, {})) for p in PHASES},
        "sites": {
            p: {op: dict(s) for op, s in counter.sites.get(p, {}).items()}
            for p in PHASES
        },
        "setup": {
            "vllm": str(Path(vllm.__file__).parent),
            "attention": type(absorb.impl).__name__,
            # The platform's fp8 with AITER FP8 BMM (W_V), else bf16 (W_UV).
            "absorb": str(
                (absorb.W_V if hasattr(absorb, "W_V") else absorb.W_UV).dtype
            ),
            "custom_ops": ",".join(config.compilation_config.custom_ops),
            "rms_norm": rms_norm,
        },
    }


def measure_target() -> dict[str, int]:
    """What the target's own layers launch in vLLM's default (compiled) config
    when they are built after the draft: an input RMSNorm, a fused residual
    add + RMSNorm and SiluAndMul, the ops the draft's kernels replace. The
    draft takes its compilation config from the target's
    (draft_compilation_config) and runs under its own IR op priority; neither
    may reach the target, whose native forms Inductor fuses."""
    import torch

    import vllm.ir
    from vllm.config import get_cached_compilation_config
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm

    from tests.verification.harness import drafter as D
    from tests.verification.harness.launches import LaunchCounter

    _install_stand_ins()
    get_cached_compilation_config.cache_clear()
    target = D.make_vllm_config(D.make_hf_config(rope=ROPE, num_layers=NUM_LAYERS))
    target.kernel_config.ir_op_priority.set_default()
    dspark = _dspark_draft_kernels(D.drafter_class())
    if dspark is not None:
        draft = copy.copy(target)
        draft.compilation_config = dspark.draft_compilation_config(
            target.compilation_config
        )
        with D.config_context(draft):
            RMSNorm(64), SiluAndMul()  # the draft's layers
        with dspark.draft_ir_op_priority(target).set_priority():
            pass  # a draft step
    with D.config_context(target):
        norm, act = RMSNorm(64), SiluAndMul()
    x, residual, gate_up = torch.randn(4, 64), torch.randn(4, 64), torch.randn(4, 128)
    counter = LaunchCounter(sites_under=str(Path(vllm.ir.__file__).parents[1]) + "/")
    with torch.inference_mode(), D.config_context(target):
        for counted in (contextlib.nullcontext(), counter):  # warm, then count
            with counted:
                norm(x), norm(x, residual.clone()), act(gate_up)
    return dict(counter.counts.get("all", {}))


# --------------------------------------------------------------------------
# Driving the emulated processes
# --------------------------------------------------------------------------


@contextlib.contextmanager
def aiter_zygotes() -> Iterator[dict[str, Zygote]]:
    """{arch: an emulated process of the arch in the AITER FP8 BMM regime}."""
    zygotes = {arch: Zygote(f"rocm-{arch}", aiter=True) for arch in AITER_MODULES}
    try:
        yield zygotes
    finally:
        for zygote in zygotes.values():
            zygote.close()


@contextlib.contextmanager
def pristine_zygote(rev: str | None = None) -> Iterator[Zygote]:
    """An emulated ROCm process importing the pristine release, or the tree
    of commit ``rev`` of build/vllm (a prefix of the stack)."""
    with tempfile.TemporaryDirectory(prefix="k3-pristine-vllm-") as tmp:
        package = extract_pristine_package(Path(tmp), rev)
        zygote = Zygote(ROCM, vllm_tree=str(package))
        try:
            yield zygote
        finally:
            zygote.close()


def measure_configs(zygote: Zygote, configs: list[Config]) -> dict[str, dict]:
    results = {}
    for c in configs:
        r = zygote.call(measure, module=c.module, cache=c.cache, mode=c.mode)
        if zygote.vllm_tree and not r["setup"]["vllm"].startswith(zygote.vllm_tree):
            raise RuntimeError(
                f"{c.id} ran vLLM from {r['setup']['vllm']}, not from "
                f"{zygote.vllm_tree}: an installed vLLM shadows PYTHONPATH"
            )
        results[c.id] = r
    return results


def measure_all(
    patched: Zygote,
    pristine: Zygote,
    aiter: dict[str, Zygote] | None = None,
) -> dict[str, dict]:
    """{config id: measurement} of the baseline configurations (in
    ``pristine``), of the patched NVIDIA and AMD modules (in ``patched``) and,
    given ``aiter`` ({arch: zygote}), of each arch's AITER configurations (in
    its zygote); the zygotes work at the same time."""
    work = [(pristine, configs("baseline")), (patched, configs("nvidia", "amd"))]
    for arch, zygote in (aiter or {}).items():
        work.append((zygote, configs(AITER_MODULES[arch], NVIDIA_AITER_MODULES[arch])))
    with ThreadPoolExecutor(max_workers=len(work)) as pool:
        jobs = [pool.submit(measure_configs, z, c) for z, c in work]
        return {k: v for job in jobs for k, v in job.result().items()}


def above_the_release(results: dict[str, dict]) -> list[str]:
    """One line per tree configuration (TREE_CONFIGS) whose draft layer or
    step launches more kernels than 0.34.0's in the same cache and mode."""
    lines = []
    for c in TREE_CONFIGS:
        tree, release = results[c.id]["counts"], results[c.baseline.id]["counts"]
        for what, n, base in (
            ("a further layer", launches(tree["layer"]), launches(release["layer"])),
            (
                f"a step ({NUM_LAYERS} layers)",
                step_total(tree, NUM_LAYERS),
                step_total(release, NUM_LAYERS),
            ),
        ):
            if n > base:
                lines.append(f"{c.id}: {what} launches {n}, {base_tag()} {base}")
    return lines


# --------------------------------------------------------------------------
# Comparing and printing
# --------------------------------------------------------------------------


def launches(counts: dict[str, int]) -> int:
    return sum(counts.values())


def step_total(counts: dict[str, dict[str, int]], num_layers: int) -> int:
    return (
        launches(counts["context_kv"])
        + launches(counts["first_layer"])
        + (num_layers - 1) * launches(counts["layer"])
        + launches(counts["model"])
    )


def delta(base: dict[str, int], other: dict[str, int]) -> dict[str, int]:
    """{op: other - base} for every op whose count differs."""
    ops = sorted(set(base) | set(other))
    return {
        op: other.get(op, 0) - base.get(op, 0)
        for op in ops
        if other.get(op, 0) != base.get(op, 0)
    }


def pin_string(counts: dict[str, int]) -> str:
    return " ".join(f"{op}={n}" for op, n in sorted(counts.items()))


def parse_pin(text: str) -> dict[str, int]:
    ops = (item.rsplit("=", 1) for item in text.split())
    return {op: int(n) for op, n in ops}


def pin_mismatches(
    pinned: dict[str, str], counts: dict[str, dict[str, int]]
) -> list[str]:
    """One line per op whose measured count differs from the pinned one."""
    lines = []
    for phase in PHASES:
        pins = parse_pin(pinned[phase])
        for op, n in delta(pins, counts[phase]).items():
            lines.append(
                f"{phase}: {op} pinned {pins.get(op, 0)}, "
                f"measured {counts[phase].get(op, 0)} ({n:+d})"
            )
    return lines


def amd_extras(counts_by_id: dict[str, dict]) -> dict[str, dict[str, int]]:
    """{"<config> <phase>": {op: n}}: ops the AMD module launches n more times
    than the baseline."""
    extras = {}
    for config in CONFIGS:
        if not config.module.startswith("amd"):
            continue
        for phase in PHASES:
            d = delta(
                counts_by_id[config.baseline.id][phase], counts_by_id[config.id][phase]
            )
            if more := {op: n for op, n in d.items() if n > 0}:
                extras[f"{config.id} {phase}"] = more
    return extras


def _ops_cell(counts: dict[str, int]) -> str:
    return ", ".join(f"{op} ×{n}" for op, n in sorted(counts.items())) or "-"


def _sites_cell(sites: dict[str, int]) -> str:
    top = sorted(sites.items(), key=lambda kv: -kv[1])
    return "; ".join(f"{site} ×{n}" for site, n in top)


def _aiter_fp8s() -> str:
    """Each AITER arch's fp8 absorb weights: "e4m3fnuz on gfx942, ..."."""
    return ", ".join(
        f"{str(FP8_DTYPES[arch]).removeprefix('torch.float8_')} on {arch}"
        for arch in AITER_MODULES
    )


def render(results: dict[str, dict]) -> str:
    out = [
        "## Kernel budget of one K3 DSpark draft step (emulated ROCm)",
        "",
        "Kernel launches counted on CPU (tests/verification/kernel_budget.py "
        f"says what counts). Synthetic draft: {NUM_LAYERS} layers, {ROPE} RoPE, "
        f"TRITON_MLA, {CONTEXT_TOKENS} context tokens, a {BLOCK_TOKENS}-token "
        "block. compiled = vLLM's default config, eager = --enforce-eager. "
        "A step with L layers launches context KV + first layer + (L-1) x "
        "further layer + model. Emulated gfx942 (MI300), but for the AITER "
        "rows: each runs its arch's AITER FP8 BMM on the arch's fp8 "
        f"({_aiter_fp8s()}). No FP4 BMM rows (gfx950): the pinned aiter lacks "
        "batched_gemm_a16wfp4.",
        "",
        "| configuration | KV cache | mode | "
        + " | ".join(PHASE_TITLES[p] for p in PHASES)
        + f" | step ({NUM_LAYERS} layers) |",
        "|" + " --- |" * (len(PHASES) + 4),
    ]
    for c in CONFIGS:
        counts = results[c.id]["counts"]
        cells = [str(launches(counts[p])) for p in PHASES]
        out.append(
            f"| {c.label} | {c.cache} | {c.mode} | "
            + " | ".join(cells)
            + f" | {step_total(counts, NUM_LAYERS)} |"
        )
    out += _render_amd_vs_baseline(results)
    out += ["", "### Launches by op", ""]
    for c in CONFIGS:
        setup = results[c.id]["setup"]
        out += [
            f"#### {c.label}, {c.cache} cache, {c.mode}",
            "",
            f"attention impl {setup['attention']}; custom_ops "
            f"{setup['custom_ops']}; rms_norm IR priority {setup['rms_norm']}; "
            f"absorb weights {setup['absorb']}",
            "",
            "| phase | launches | ops |",
            "| --- | --- | --- |",
        ]
        for p in PHASES:
            counts = results[c.id]["counts"][p]
            out.append(
                f"| {PHASE_TITLES[p]} | {launches(counts)} | {_ops_cell(counts)} |"
            )
        out.append("")
    return "\n".join(out)


def _render_amd_vs_baseline(results: dict[str, dict]) -> list[str]:
    out = [
        "",
        "### AMD module vs baseline",
        "",
        "Ops the AMD module launches more (+) or less (-) often than the "
        "baseline, per phase; every extra needs a cause (ALLOWED_EXTRA).",
        "",
        "| AMD | KV cache | mode | phase | op | baseline | AMD | Δ | cause | where |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    legend = ["", "Causes:", ""] + [
        f"* **{cause}**: {reason}." for cause, reason in EXTRA_CAUSES.items()
    ]
    for amd in CONFIGS:
        if not amd.module.startswith("amd"):
            continue
        for phase in PHASES:
            b = results[amd.baseline.id]["counts"][phase]
            a = results[amd.id]["counts"][phase]
            for op, n in delta(b, a).items():
                side = amd if n > 0 else amd.baseline
                sites = results[side.id]["sites"][phase].get(op, {})
                reason = ""
                if n > 0:
                    reason = ", ".join(ALLOWED_EXTRA.get(op, ("**none given**",)))
                aiter = f"AITER {amd.aiter_arch}" if amd.aiter_arch else "-"
                out.append(
                    f"| {aiter} | {amd.cache} | {amd.mode} | {PHASE_TITLES[phase]} | {op} | "
                    f"{b.get(op, 0)} | {a.get(op, 0)} | {n:+d} | {reason} | "
                    f"{_sites_cell(sites)} |"
                )
    return out + legend


def stack_trees() -> list[tuple[str, str]]:
    """(commit, title) of the release and of the tree after each patch of
    build/vllm's stack, oldest first."""
    log = subprocess.run(
        [
            "git",
            "-C",
            str(pristine_git_dir()),
            "log",
            "--reverse",
            "--format=%H %s",
            f"{base_tag()}..HEAD",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    trees = [(base_tag(), base_tag())]
    for k, line in enumerate(log.splitlines(), start=1):
        commit, subject = line.split(" ", 1)
        trees.append((commit, f"patch {k}: {subject}"))
    return trees


def measure_tree(rev: str) -> dict[str, dict]:
    """TREE_CONFIGS measured in the tree of commit ``rev``."""
    with pristine_zygote(rev) as zygote:
        return measure_configs(zygote, TREE_CONFIGS)


def render_prefixes(trees: list[tuple[str, str]], results: list[dict]) -> str:
    """A row per tree of the stack and platform: the launches of a further
    draft layer / of a step, per KV cache and mode."""
    modes = [(c.cache, c.mode) for c in configs("baseline")]
    out = [
        "## Kernel budget of one K3 DSpark draft step, per prefix of the stack",
        "",
        "Launches of a further draft layer / of a "
        f"{NUM_LAYERS}-layer step (tests/verification/kernel_budget.py says "
        "what counts), counted on CPU under emulated ROCm (gfx942). NVIDIA: the "
        "NVIDIA module; ROCm: what the registry gives ROCm. compiled = vLLM's "
        "default config, eager = --enforce-eager.",
        "",
        "| tree | platform | " + " | ".join(f"{c} {m}" for c, m in modes) + " |",
        "|" + " --- |" * (len(modes) + 2),
    ]
    for (_, title), result in zip(trees, results):
        for platform, module in PLATFORM_MODULES.items():
            cells = []
            for cache, mode in modes:
                counts = result[Config(module, cache, mode).id]["counts"]
                cells.append(
                    f"{launches(counts['layer'])} / {step_total(counts, NUM_LAYERS)}"
                )
            out.append(f"| {title} | {platform} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def pins_literal(results: dict[str, dict]) -> str:
    lines = ["PINS = {"]
    for c in CONFIGS:
        lines.append(f'    "{c.id}": {{')
        for p in PHASES:
            lines.append(f'        "{p}": "{pin_string(results[c.id]["counts"][p])}",')
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.verification.kernel_budget",
        description="Print the kernel budget of one K3 DSpark draft step.",
    )
    parser.add_argument(
        "--print-pins",
        action="store_true",
        help="print the PINS literal of tests/verification/test_kernel_budget.py",
    )
    parser.add_argument(
        "--prefixes",
        action="store_true",
        help="print the budget of the release and of every prefix of build/vllm's stack",
    )
    args = parser.parse_args(argv)
    if args.prefixes:
        trees = stack_trees()
        with ThreadPoolExecutor(max_workers=2) as pool:
            results = list(pool.map(measure_tree, [commit for commit, _ in trees]))
        print(render_prefixes(trees, results))
        return 0
    patched = Zygote(ROCM)
    try:
        with pristine_zygote() as pristine, aiter_zygotes() as aiter:
            results = measure_all(patched, pristine, aiter=aiter)
    except FileNotFoundError as exc:  # no pristine release to compare with
        print(f"kernel budget: {exc}", file=sys.stderr)
        return 1
    finally:
        patched.close()
    print(pins_literal(results) if args.print_pins else render(results))
    return 0


if __name__ == "__main__":
    # Re-import under the package name: the zygotes resolve ``measure`` by it.
    from tests.verification import kernel_budget

    sys.exit(kernel_budget.main())
