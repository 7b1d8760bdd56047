"""Inside an image, on the GPUs: versions and which K3 DSpark drafter vLLM resolves.

`python3 -m scripts.runbook.probe` prints one JSON object (the last line of
its output). The runbook's preflight runs it in A and B: A must resolve the
NVIDIA module (the release), B the AMD one (the overlay), both on the GPU
architecture of the machine named with --machine.
"""

from __future__ import annotations

import importlib.util
import json


def _version(package: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:  # noqa: BLE001 - absent or unreadable: reported as None
        return None


def probe() -> dict:
    import torch
    import vllm

    from scripts.image.rocm_smoke import resolved_drafter_modules

    props = torch.cuda.get_device_properties(0) if torch.cuda.device_count() else None
    return {
        "vllm": vllm.__version__,
        "vllm_path": vllm.__file__,
        "torch": torch.__version__,
        "hip": getattr(torch.version, "hip", None),
        "gpu": getattr(props, "name", None),
        "gcn_arch": getattr(props, "gcnArchName", None),
        "gpu_count": torch.cuda.device_count(),
        "drafter": resolved_drafter_modules(),
        "pytest": _version("pytest"),
        "lm_eval": _version("lm_eval") or _version("lm-eval"),
        "aiter": importlib.util.find_spec("aiter") is not None,
    }


if __name__ == "__main__":
    print(json.dumps(probe()))
