"""Make vLLM's real ``RocmPlatform`` (or ``CudaPlatform``) current on a CPU box.

`activate(mode)` must run before anything imports vLLM. It answers the device
queries vLLM makes while resolving the platform (``gcnArchName`` for ROCm,
compute capability for CUDA), registers CPU bodies for the compiled ops the
drafter touches (``ops.install``) and stubs the two things a driver-less CUDA
build of torch cannot answer (stream capture state, vLLM's workspace manager).
The device is the CPU: ``torch.cuda.is_available()`` is False, collectives go
through vLLM's CPU communicator, and vLLM's model-class inspection runs in this
(emulated) process with a cache of its own.
Never call it in a pytest process that also runs default-platform tests: it
is per-process and cannot be undone. The zygote applies it in a dedicated
child process; the ``rocm_emulation`` pytest plugin in a pytest process of its
own.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

MODES = ("rocm-gfx942", "rocm-gfx950", "cuda-sm90")

_ACTIVE: str | None = None


def active_mode() -> str | None:
    return _ACTIVE


def _fake_props(mode: str):
    if mode.startswith("rocm"):
        arch = mode.split("-", 1)[1]
        major, minor = {"gfx942": (9, 4), "gfx950": (9, 5)}[arch]
        name = {"gfx942": "AMD Instinct MI300X", "gfx950": "AMD Instinct MI355X"}[arch]
        return SimpleNamespace(
            name=name,
            gcnArchName=f"{arch}:sramecc+:xnack-",
            major=major,
            minor=minor,
            total_memory=192 << 30,
            multi_processor_count=304,
            L2_cache_size=4 << 20,
            warp_size=64,
        )
    return SimpleNamespace(
        name="NVIDIA H100 80GB HBM3",
        gcnArchName="",
        major=9,
        minor=0,
        total_memory=80 << 30,
        multi_processor_count=132,
        L2_cache_size=50 << 20,
        warp_size=32,
    )


class _TritonDriverStub:
    """Answers Triton's target queries without a GPU driver (nothing launches)."""

    def __init__(self, backend: str, arch, warp_size: int) -> None:
        self._target = SimpleNamespace(backend=backend, arch=arch, warp_size=warp_size)
        self.utils = SimpleNamespace(
            get_device_properties=lambda i: {
                "max_shared_mem": 64 << 10,
                "multiprocessor_count": 1,
            }
        )

    def get_current_target(self):
        return self._target

    def get_current_device(self) -> int:
        return 0

    def is_active(self) -> bool:
        return True


def _install_triton_driver_stub(mode: str, props) -> None:
    try:
        import triton.runtime.driver as driver
    except ImportError:
        return
    if mode.startswith("rocm"):
        stub = _TritonDriverStub("hip", props.gcnArchName.split(":")[0], 64)
    else:
        stub = _TritonDriverStub("cuda", props.major * 10 + props.minor, 32)
    driver.set_active(stub)


class _NoPrefillBackend:
    """Placeholder MLA prefill backend when none is installable on this box
    (ROCm wants aiter or flash-attn). Draft blocks here are decode-only."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    @staticmethod
    def get_name() -> str:
        return "HARNESS_NO_PREFILL"

    def __getattr__(self, name):
        raise NotImplementedError(f"harness has no MLA prefill backend ({name})")


def _stub_missing_prefill_backend(platform) -> None:
    real = platform.get_mla_prefill_backend_cls

    def get_mla_prefill_backend_cls(selector_config):
        try:
            return real(selector_config)
        except ValueError:
            return _NoPrefillBackend

    platform.get_mla_prefill_backend_cls = get_mla_prefill_backend_cls


def _keep_model_inspection_emulated(mode: str) -> None:
    """vLLM learns a model class's capabilities (``_ModelInfo``) in a fresh
    interpreter, to keep CUDA out of its own; that interpreter would resolve
    this machine's platform, not the emulated one, and there is no device to
    keep out here. It also caches them on disk keyed by the source files only:
    an emulated process keeps its own cache, apart from un-emulated runs."""
    import vllm.envs as envs
    from vllm.model_executor.models import registry

    os.environ["VLLM_CACHE_ROOT"] = os.path.join(
        envs.VLLM_CACHE_ROOT, f"emulated-{mode}"
    )
    registry._run_in_subprocess = lambda fn: fn()


def activate(mode: str, *, aiter: bool = False) -> None:
    """``aiter``: the AITER-on world (``harness/aiter.py``: aiter's Triton
    kernels importable through a stand-in package, VLLM_ROCM_USE_AITER=1);
    by default aiter is blocked from import, as if it were not installed."""
    global _ACTIVE
    if mode not in MODES:
        raise ValueError(f"unknown platform mode {mode!r}; expected one of {MODES}")
    if _ACTIVE is not None:
        if _ACTIVE != mode:
            raise RuntimeError(f"platform already emulated as {_ACTIVE}, not {mode}")
        return
    leaked = [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]
    if leaked:
        raise RuntimeError(
            "platform emulation must be applied before vLLM is imported; "
            f"already imported: {sorted(leaked)[:5]}"
        )
    assert "amdsmi" not in sys.modules and "aiter" not in sys.modules

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from . import aiter as aiter_world

    if aiter and mode.startswith("rocm"):
        aiter_world.install_stand_in()
        os.environ["VLLM_ROCM_USE_AITER"] = "1"
    else:
        # amd-aiter is installed (requirements/venv.lock) but its package
        # cannot run here: vLLM must see it absent, and nothing may turn it on.
        aiter_world.block()
        os.environ["VLLM_ROCM_USE_AITER"] = "0"

    import torch

    props = _fake_props(mode)
    torch.cuda.get_device_properties = lambda *a, **k: props
    torch.cuda.get_device_capability = lambda *a, **k: (props.major, props.minor)
    torch.cuda.get_device_name = lambda *a, **k: props.name
    torch.cuda.device_count = lambda: 1
    # A CUDA build of torch without a driver raises here; nothing is captured.
    torch.cuda.is_current_stream_capturing = lambda: False

    _install_triton_driver_stub(mode, props)

    import vllm.platforms as platforms

    if mode.startswith("rocm"):
        from vllm.platforms.rocm import RocmPlatform

        platform = RocmPlatform()
    else:
        from vllm.platforms.cuda import CudaPlatform

        platform = CudaPlatform()
    # The device is the CPU: tensors live there, the kernels are references.
    platform.device_type = "cpu"
    # vLLM's own custom ops (unified attention, cache update) register under
    # the platform's dispatch key; our tensors are CPU tensors.
    platform.dispatch_key = "CPU"
    # More than one rank: the platform's device communicator is the GPU one
    # (NCCL/RCCL); the CPU's runs the collectives over gloo.
    platform.get_device_communicator_cls = lambda: (
        "vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator"
    )
    _stub_missing_prefill_backend(platform)
    platforms._current_platform = platform
    _keep_model_inspection_emulated(mode)
    # vLLM decides once, when vllm.triton_utils is imported, whether Triton has
    # an active driver (the stub above; Triton's CUDA driver also asks
    # is_available()), so that import comes first. Then: there is no device
    # memory, tensors live on the CPU. vLLM sets PYTORCH_NVML_BASED_CUDA_CHECK,
    # which makes is_available() read the device count above; code that puts
    # tensors on "cuda" when a GPU is available must keep them on the CPU.
    import vllm.triton_utils  # noqa: F401

    torch.cuda.is_available = lambda: False

    from . import ops

    ops.install(mode)
    _ACTIVE = mode
