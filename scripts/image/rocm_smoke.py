"""Smoke check of a ROCm image with the stack: the K3 DSpark drafter is the AMD one.

`python3 scripts/image/rocm_smoke.py` runs inside a ROCm image after the overlay is
installed (docker/Dockerfile.rocm-overlay's last step). vLLM picks the drafter
class when `vllm.models.kimi_k3` is imported, from the current platform, and
the model registry hands that class out for "K3DSparkModel"; both must be the
class of `vllm/models/kimi_k3/amd/dspark_mla.py`.

An image build sees no GPU, so vLLM cannot detect ROCm by itself there. Then
the check makes vLLM's real `RocmPlatform` current and answers its one device
query (the GPU architecture) with `--gcn-arch`, on the image's ROCm build of
torch. With a GPU visible (`docker run --device /dev/kfd ...`) nothing is
stood in for. Only the standard library is imported before vLLM.
"""

from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

AMD_DRAFTER_MODULE = "vllm.models.kimi_k3.amd.dspark_mla"
REGISTRY_NAME = "K3DSparkModel"

# Device properties vLLM reads while importing its ROCm platform.
_GPUS = {
    "gfx942": SimpleNamespace(name="AMD Instinct MI300X", major=9, minor=4),
    "gfx950": SimpleNamespace(name="AMD Instinct MI355X", major=9, minor=5),
}


class SmokeError(Exception):
    """The image does not resolve the drafter as the stack intends."""


def resolved_drafter_modules() -> dict[str, str | None]:
    """Where the package re-export and the model registry get the drafter from."""
    import vllm.models.kimi_k3 as kimi_k3
    from vllm.model_executor.models.registry import ModelRegistry

    # vLLM 0.34.0 as released neither exports the drafter from the package nor
    # registers it through it: None, or the NVIDIA module, is what it reports.
    exported = getattr(kimi_k3, "K3DSparkForCausalLM", None)
    registered = ModelRegistry._try_load_model_cls(REGISTRY_NAME)
    return {
        "vllm.models.kimi_k3.K3DSparkForCausalLM": exported.__module__ if exported else None,
        f"ModelRegistry[{REGISTRY_NAME!r}]": registered.__module__ if registered else None,
    }


def check_drafter_dispatch() -> dict[str, str | None]:
    """Raise SmokeError unless both resolve to the AMD drafter; return what they are."""
    resolved = resolved_drafter_modules()
    wrong = {name: module for name, module in resolved.items()
             if module != AMD_DRAFTER_MODULE}
    if wrong:
        raise SmokeError("; ".join(f"{name} comes from {module}" for name, module in wrong.items())
                         + f", not {AMD_DRAFTER_MODULE}: the overlay is missing or "
                         "the platform is not ROCm")
    return resolved


def make_rocm_current(gcn_arch: str) -> str:
    """Make vLLM's RocmPlatform current; return how the platform was found."""
    import torch

    if not getattr(torch.version, "hip", None):
        raise SmokeError(f"torch {torch.__version__} is not a ROCm build; "
                         "this check is for ROCm images")
    if torch.cuda.device_count() > 0:
        from vllm.platforms import current_platform

        if not current_platform.is_rocm():
            raise SmokeError(f"a GPU is visible but vLLM detected {type(current_platform).__name__}")
        return "detected (a GPU is visible)"
    if gcn_arch not in _GPUS:
        raise SmokeError(f"--gcn-arch {gcn_arch!r}: expected one of {sorted(_GPUS)}")
    gpu = _GPUS[gcn_arch]
    props = SimpleNamespace(gcnArchName=gcn_arch, name=gpu.name, major=gpu.major,
                            minor=gpu.minor, multi_processor_count=304,
                            total_memory=192 << 30)
    # vLLM's ROCm platform asks amdsmi, then torch, for the architecture at import.
    torch.cuda.get_device_properties = lambda *args, **kwargs: props
    # No device, so no kernels are chosen: keep optional AITER imports out of it.
    os.environ["VLLM_ROCM_USE_AITER"] = "0"
    import vllm.platforms
    from vllm.platforms.rocm import RocmPlatform

    vllm.platforms.current_platform = RocmPlatform()
    return f"RocmPlatform made current for {gcn_arch} (no GPU visible)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rocm_smoke.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gcn-arch", default="gfx942", choices=sorted(_GPUS),
                        help="GPU architecture to assume when no GPU is visible")
    args = parser.parse_args(argv)
    try:
        how = make_rocm_current(args.gcn_arch)
        resolved = check_drafter_dispatch()
    except SmokeError as e:
        print(f"rocm smoke check: FAILED: {e}", file=sys.stderr)
        return 1
    print(f"rocm smoke check: platform {how}")
    for name, module in resolved.items():
        print(f"rocm smoke check: {name} -> {module}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
