"""`fetch`: download through pip's index, verify against pin.toml, quarantine the rest."""

from __future__ import annotations

import base64
import shutil

import pytest

from tests.tooling.conftest import V1, sha256_file


@pytest.fixture
def remote(project, index):
    """The project with an empty download cache and an index serving its release."""
    import shutil
    shutil.rmtree(project.cache)
    sdist, wheel = project.release(V1)
    index.add(sdist, wheel)
    project.index_url = index.url
    project.sdist, project.wheel = sdist, wheel
    return project


def cached(proj) -> list[str]:
    return sorted(p.name for p in proj.downloads.iterdir()) if proj.downloads.exists() else []


def quarantined(proj) -> list[str]:
    return sorted(p.name for p in proj.quarantine.iterdir()) if proj.quarantine.exists() else []


def test_fetch_downloads_verifies_and_never_downloads_again(remote, index):
    result = remote.ok("fetch")
    sdist, wheel = remote.sdist, remote.wheel
    assert str(remote.downloads / sdist.name) in result.stdout
    assert (remote.downloads / sdist.name).read_bytes() == sdist.read_bytes()
    assert (remote.downloads / wheel.name).read_bytes() == wheel.read_bytes()
    assert index.downloads(sdist.name) == 1 and index.downloads(wheel.name) == 1
    assert not any(name.endswith(".part") for name in cached(remote))
    seen = len(index.requests)

    remote.ok("fetch")
    remote.ok("apply")  # uses the cached sdist too
    assert len(index.requests) == seen, index.requests[seen:]
    assert quarantined(remote) == []


def test_fetch_through_a_pep503_html_index(remote, index):
    index.html = True
    remote.ok("fetch")
    assert sha256_file(remote.downloads / remote.sdist.name) == sha256_file(remote.sdist)
    assert index.requests[0] == "/simple/vllm/"


def test_apply_downloads_the_sdist_when_it_is_not_cached(remote, index):
    remote.ok("apply")
    assert index.downloads(remote.sdist.name) == 1
    assert index.downloads(remote.wheel.name) == 0  # apply needs only the sdist
    assert remote.git("tag") == f"vllm-{V1}"


@pytest.mark.parametrize("damage", ["size", "sha256"])
def test_download_not_matching_the_pin_is_quarantined(remote, index, damage):
    name = remote.sdist.name
    good = remote.sdist.read_bytes()
    # The index lists the pinned hash but serves other bytes (a bad mirror, bit rot).
    index.listed_sha256[name] = sha256_file(remote.sdist)
    bad = good + b"junk" if damage == "size" else good[:-1] + bytes([good[-1] ^ 1])
    index.files[name] = bad
    result = remote.run("fetch")
    assert result.returncode == 1
    assert f"downloaded {name} does not match pin.toml" in result.stderr
    assert "quarantine" in result.stderr and "not used" in result.stderr
    assert name not in cached(remote) and f"{name}.part" not in cached(remote)
    (moved,) = quarantined(remote)
    assert moved.startswith(name)
    assert (remote.quarantine / moved).read_bytes() == bad
    # apply does not build anything from it either.
    result = remote.run("apply")
    assert result.returncode == 1 and not remote.tree.exists()
    assert name not in cached(remote)


def test_index_listing_another_hash_is_refused_before_downloading(remote, index):
    name = remote.sdist.name
    index.listed_sha256[name] = "0" * 64
    result = remote.run("fetch")
    assert result.returncode == 1
    assert name in result.stderr and "pin.toml" in result.stderr
    assert index.downloads() == 0
    assert cached(remote) == []


def test_file_missing_from_the_index_is_named(remote, index):
    del index.files[remote.sdist.name]
    result = remote.run("fetch")
    assert result.returncode == 1
    assert f"no file {remote.sdist.name} for vllm" in result.stderr


def test_unreachable_index_names_the_file_and_the_downloads_folder(remote):
    remote.cache_env = False  # the default cache: <project>/.cache
    remote.index_url = f"http://127.0.0.1:{_closed_port()}/simple"
    result = remote.run("fetch")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert f"cannot download {remote.sdist.name}" in result.stderr
    assert remote.index_url in result.stderr
    assert ".cache/downloads/" in result.stderr
    assert not (remote.root / ".cache" / "downloads" / remote.sdist.name).exists()


def test_unreachable_index_names_the_configured_downloads_folder(remote):
    remote.index_url = f"http://127.0.0.1:{_closed_port()}/simple"
    result = remote.run("fetch")
    assert result.returncode == 1
    assert str(remote.downloads) in result.stderr


def test_a_part_file_left_behind_is_never_taken_as_good(remote, index):
    name = remote.sdist.name
    remote.downloads.mkdir(parents=True)
    good = remote.sdist.read_bytes()
    # Even a complete .part (interrupted before its rename) is not trusted.
    (remote.downloads / f"{name}.part").write_bytes(good)
    served_url, remote.index_url = remote.index_url, f"http://127.0.0.1:{_closed_port()}/simple"
    result = remote.run("apply")
    assert result.returncode == 1 and name in result.stderr
    assert not remote.tree.exists()
    assert name not in cached(remote)

    remote.index_url = served_url
    remote.ok("fetch")
    assert index.downloads(name) == 1
    assert (remote.downloads / name).read_bytes() == good
    assert f"{name}.part" not in cached(remote)


def test_a_connection_closed_early_is_never_taken_as_good(remote, index):
    name = remote.sdist.name
    index.truncate.add(name)
    result = remote.run("fetch")
    assert result.returncode == 1
    assert name in result.stderr and "Traceback" not in result.stderr
    assert name not in cached(remote)
    # Retrying once the server behaves gives the verified file.
    index.truncate.clear()
    remote.ok("fetch")
    assert sha256_file(remote.downloads / name) == sha256_file(remote.sdist)


def test_a_chunked_download_cut_mid_way_fails_cleanly(remote, index):
    name = remote.sdist.name
    index.chunked_cut.add(name)
    result = remote.run("fetch")
    assert result.returncode != 0
    assert name not in cached(remote)
    assert "Traceback" not in result.stderr, result.stderr
    assert name in result.stderr


def test_a_corrupt_cached_file_is_quarantined_and_downloaded_again(remote, index):
    name = remote.sdist.name
    remote.downloads.mkdir(parents=True)
    (remote.downloads / name).write_bytes(b"not a tarball")
    result = remote.ok("fetch")
    assert f"cached {name} does not match pin.toml" in result.stderr
    assert index.downloads(name) == 1
    assert sha256_file(remote.downloads / name) == sha256_file(remote.sdist)
    (moved,) = quarantined(remote)
    assert (remote.quarantine / moved).read_bytes() == b"not a tarball"


def test_a_cached_file_changed_after_verification_is_not_trusted(remote, index):
    remote.ok("fetch")
    name = remote.sdist.name
    path = remote.downloads / name
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(bytes(data))  # same size, new mtime: the .verified stamp is stale
    remote.ok("fetch")
    assert index.downloads(name) == 2
    assert sha256_file(path) == sha256_file(remote.sdist)


def _closed_port() -> int:
    from tests.tooling.conftest import free_port
    return free_port()


# --- every network step has a deadline; credentials are used, never shown ----------


@pytest.mark.parametrize("where", ["page", "sdist"])
def test_a_trickling_index_is_given_up_on_at_the_deadline(remote, index, where):
    index.drip.add("page" if where == "page" else remote.sdist.name)
    remote.extra_env["K3_NETWORK_DEADLINE"] = "0.5"
    result = remote.run("fetch", timeout=30)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "gives up after 0.5 s" in result.stdout  # said before it waits
    assert ("no complete answer within 0.5 s" if where == "page"
            else "stopped: ") in result.stderr
    assert not any(name.startswith(remote.sdist.name) for name in cached(remote))


def test_index_credentials_are_sent_to_the_index_and_never_shown(remote, index):
    secret = "s3cr3t-t0ken"
    remote.index_url = index.url.replace("http://", f"http://ci-user:{secret}@")
    result = remote.ok("fetch")
    assert secret not in result.stdout + result.stderr
    expected = "Basic " + base64.b64encode(f"ci-user:{secret}".encode()).decode()
    assert index.authorizations == [expected] * len(index.requests)  # page and files
    remote.index_url = f"http://ci-user:{secret}@127.0.0.1:{_closed_port()}/simple"
    shutil.rmtree(remote.cache)
    result = remote.run("fetch")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and secret not in result.stderr
    assert "http://***@127.0.0.1" in result.stderr


def test_a_file_index_is_read_as_pip_reads_it(remote, tmp_path):
    """pip takes `file://` index URLs: one folder per project with an index.html."""
    simple = tmp_path / "mirror" / "simple"
    (simple / "vllm").mkdir(parents=True)
    links = "".join(f'<a href="../../files/{p.name}#sha256={sha256_file(p)}">{p.name}</a>\n'
                    for p in (remote.sdist, remote.wheel))
    (simple / "vllm" / "index.html").write_text(f"<html><body>\n{links}</body></html>\n")
    (tmp_path / "mirror" / "files").mkdir()
    for p in (remote.sdist, remote.wheel):
        shutil.copy(p, tmp_path / "mirror" / "files" / p.name)
    remote.index_url = simple.as_uri()
    result = remote.ok("fetch")
    assert "offline" not in result.stderr
    assert cached(remote) == sorted([remote.sdist.name, remote.wheel.name])
