"""Make vLLM's real ``RocmPlatform`` (or ``CudaPlatform``) current on a CPU box.

`activate(mode)` must run before anything imports vLLM. It answers the device
queries vLLM makes while resolving the platform (``gcnArchName`` for ROCm,
compute capability for CUDA), registers CPU bodies for the compiled ops the
drafter touches (``ops.install``) and stubs the two things a driver-less CUDA
build of torch cannot answer (stream capture state, vLLM's workspace manager).
Never call it in the pytest process itself: it is per-process and cannot be
undone; the zygote applies it in a dedicated child process.
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


def activate(mode: str) -> None:
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
    # aiter is not installed; make sure nothing tries to turn it on.
    os.environ["VLLM_ROCM_USE_AITER"] = "0"

    import torch

    props = _fake_props(mode)
    torch.cuda.get_device_properties = lambda *a, **k: props
    torch.cuda.get_device_capability = lambda *a, **k: (props.major, props.minor)
    torch.cuda.get_device_name = lambda *a, **k: props.name
    torch.cuda.device_count = lambda: 1
    # A CUDA build of torch without a driver raises here; nothing is captured.
    torch.cuda.is_current_stream_capturing = lambda: False

    import vllm.platforms as platforms

    if mode.startswith("rocm"):
        from vllm.platforms.rocm import RocmPlatform

        platform = RocmPlatform()
    else:
        from vllm.platforms.cuda import CudaPlatform

        platform = CudaPlatform()
    # The device is the CPU: tensors live there, the kernels are references.
    platform.device_type = "cpu"
    platforms._current_platform = platform

    from . import ops

    ops.install(mode)
    _ACTIVE = mode
