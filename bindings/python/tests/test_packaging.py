# SPDX-License-Identifier: MIT
"""The offline build backend (_libdion_build.py) and the package metadata."""
import base64
import hashlib
import importlib
import os
import re
import tarfile
import zipfile

import pytest

from conftest import BINDING_ROOT
from libdion import _lib as L


@pytest.fixture
def backend(monkeypatch):
    if not os.path.isfile(os.path.join(BINDING_ROOT, "_libdion_build.py")):
        pytest.skip("not a source tree")
    monkeypatch.syspath_prepend(BINDING_ROOT)
    mod = importlib.import_module("_libdion_build")
    monkeypatch.setattr(mod, "_setuptools", None)  # the path taken by an isolated (offline) pip build
    return mod


def test_pyproject_version_matches_the_binding():
    text = open(os.path.join(BINDING_ROOT, "pyproject.toml")).read()
    version = re.search(r'^version\s*=\s*"([^"]+)"', text, re.M).group(1)
    assert version == L.version_string(L.DION_VERSION_CODE)
    assert re.search(r"^requires\s*=\s*\[\]", text, re.M), "an isolated offline build must need nothing"


def test_stdlib_wheel_has_the_package_and_a_valid_record(backend, tmp_path):
    assert backend.get_requires_for_build_wheel() == []
    name = backend.build_wheel(str(tmp_path))
    assert name == "libdion-%s-py3-none-any.whl" % L.version_string(L.DION_VERSION_CODE)
    with zipfile.ZipFile(tmp_path / name) as z:
        names = set(z.namelist())
        for mod in ("__init__", "__main__", "_lib", "core", "torch"):
            assert "libdion/%s.py" % mod in names
        di = "libdion-%s.dist-info/" % L.version_string(L.DION_VERSION_CODE)
        meta = z.read(di + "METADATA").decode()
        assert "Name: libdion" in meta and "Requires-Dist: numpy; extra == \"numpy\"" in meta
        assert "Requires-Dist: torch; extra == \"torch\"" in meta
        for line in z.read(di + "RECORD").decode().splitlines():
            arc, digest, size = line.split(",")
            if digest:
                data = z.read(arc)
                want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                assert digest == "sha256=" + want and int(size) == len(data)


def test_stdlib_editable_and_sdist(backend, tmp_path):
    name = backend.build_editable(str(tmp_path))
    with zipfile.ZipFile(tmp_path / name) as z:
        assert z.read("__editable__.libdion.pth").decode().strip() == BINDING_ROOT
    sdist = backend.build_sdist(str(tmp_path))
    with tarfile.open(tmp_path / sdist) as t:
        members = {m.name.split("/", 1)[1] for m in t.getmembers()}
    assert {"PKG-INFO", "pyproject.toml", "_libdion_build.py", "README.md", "libdion/_lib.py"} <= members
