"""PEP 508 requirements and names, from `packaging`: the interpreter's own copy
where it has one, else the copy every pip carries (the scripts run on a bare
python3, before any venv exists)."""

try:
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # pragma: no cover - depends on the machine
    from pip._vendor.packaging.requirements import (  # type: ignore[no-redef]
        InvalidRequirement,
        Requirement,
    )
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore[no-redef]

__all__ = ["InvalidRequirement", "Requirement", "canonicalize_name"]
