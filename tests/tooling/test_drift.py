"""`drift [version]`: try the stack on a newer (fake) release, changing nothing."""

from __future__ import annotations

import pytest

from tests.tooling.conftest import (
    FOO_PATCHED,
    FOO_V1,
    PATCH_1,
    PATCH_2,
    TEST_FOO_PATCHED,
    V1,
    V2,
    release_files,
    snapshot,
)


@pytest.fixture
def publish(stacked, index):
    """Serve 0.1.0 plus a 0.2.0 with the given file changes."""
    index.add(*stacked.release(V1))

    def serve(changes: dict[str, str]):
        files = release_files(V2, "g7654321")
        files.update({path: text.encode() for path, text in changes.items()})
        index.add(*stacked.release(V2, files, commit="g7654321"))
        stacked.index_url = index.url

    return serve


def _untouched(proj):
    return (proj.head(), proj.patch_bytes(), (proj.root / "pin.toml").read_text(),
            snapshot(proj.overlay))


def test_drift_picks_the_newest_release_and_reports_all_patches_apply(stacked, publish):
    publish({"vllm/models/foo.py": FOO_V1 + "\n\ndef extra():\n    return 1\n"})
    before = _untouched(stacked)
    result = stacked.run("drift")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"2 of 2 patch(es) apply strictly to vLLM {V2}" in result.stdout
    assert _untouched(stacked) == before


def test_drift_names_the_patch_and_file_that_stopped_applying(stacked, publish):
    publish({"vllm/models/foo.py": FOO_V1.replace("BLOCK = 16", "BLOCK = 32")})
    before = _untouched(stacked)
    result = stacked.run("drift", V2)
    assert result.returncode == 1
    assert f"does not apply   {PATCH_1}: vllm/models/foo.py" in result.stdout
    assert f"applies          {PATCH_2}" in result.stdout
    assert f"make rebase VLLM_VERSION={V2}" in result.stdout
    assert _untouched(stacked) == before


def test_drift_spots_a_patch_that_landed_upstream(stacked, publish):
    publish({"vllm/models/foo.py": FOO_PATCHED, "tests/test_foo.py": TEST_FOO_PATCHED})
    result = stacked.run("drift", V2)
    assert result.returncode == 1
    assert f"already upstream {PATCH_1}" in result.stdout


def test_drift_on_the_newest_release_checks_nothing(stacked, index):
    index.add(*stacked.release(V1))
    stacked.index_url = index.url
    result = stacked.run("drift")
    assert result.returncode == 0
    assert f"vLLM {V1} is the newest release" in result.stdout


def test_drift_names_a_file_upstream_deleted_and_says_to_drop_or_rehome(stacked, index):
    """Before, the deleted file was listed as an ordinary conflict, which a
    maintainer resolves by bringing the deleted module back."""
    index.add(*stacked.release(V1))
    files = release_files(V2, "g7654321")
    del files["vllm/models/foo.py"]
    index.add(*stacked.release(V2, files, commit="g7654321"))
    stacked.index_url = index.url
    result = stacked.run("drift", V2)
    assert result.returncode == 1
    assert (f"does not apply   {PATCH_1}: upstream deleted vllm/models/foo.py: drop or "
            "re-home the patch") in result.stdout
    assert f"applies          {PATCH_2}" in result.stdout
