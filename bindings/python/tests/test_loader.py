# SPDX-License-Identifier: MIT
"""The loader: search order, failures listing every candidate, version and size checks, python -m libdion."""
import ctypes
import os
import subprocess
import sys

import pytest

import libdion
from libdion import _lib as L
from conftest import BINDING_ROOT, REPO_ROOT


def _child_env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = BINDING_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def test_loaded_library_is_checked():
    path = libdion.library_path()
    assert os.path.isfile(path)
    assert libdion.library_version() // 10000 == L.DION_VERSION_MAJOR
    assert any(outcome.endswith(path) or "loaded" in outcome for _, outcome in L.search_log())


def test_bad_libdion_path_lists_the_path_tried(tmp_path):
    bad = str(tmp_path / "nowhere" / "libdion.so")
    with pytest.raises(L.DionLibraryError) as ei:
        L.load_library(env={"LIBDION_PATH": bad})
    msg = str(ei.value)
    assert bad in msg
    assert "LIBDION_PATH" in msg and "LD_LIBRARY_PATH" in msg
    assert "only candidate" in msg  # an explicit override never falls back silently
    assert ei.value.tried == [(bad, "env: no such file")]
    assert isinstance(ei.value, OSError)


def test_libdion_path_not_a_shared_object_reports_the_oserror(tmp_path):
    junk = tmp_path / "libdion.so"
    junk.write_bytes(b"this is not an ELF file\n")
    with pytest.raises(L.DionLibraryError) as ei:
        L.load_library(env={"LIBDION_PATH": str(junk)})
    msg = str(ei.value)
    assert str(junk) in msg and "OSError" in msg


def test_libdion_path_directory_means_dir_slash_libdion_so(tmp_path):
    with pytest.raises(L.DionLibraryError) as ei:
        L.load_library(env={"LIBDION_PATH": str(tmp_path)})
    assert os.path.join(str(tmp_path), "libdion.so") in str(ei.value)
    lib, path, tried = L.load_library(env={"LIBDION_PATH": os.path.dirname(libdion.library_path())})
    assert os.path.realpath(path) == os.path.realpath(libdion.library_path())


def _some_other_shared_object():
    with open("/proc/self/maps") as f:
        for line in f:
            p = line.split()[-1]
            if os.path.basename(p).startswith(("libm.so", "libm-", "libc.so", "libc-")):
                return p
    return None


def test_a_library_that_is_not_libdion_is_rejected():
    other = _some_other_shared_object()
    if other is None:
        pytest.skip("no libc/libm path found in /proc/self/maps")
    with pytest.raises(L.DionLibraryError) as ei:
        L.load_library(env={"LIBDION_PATH": other})
    assert "not libdion" in str(ei.value) and other in str(ei.value)


def test_major_version_mismatch_names_both_versions(monkeypatch):
    monkeypatch.setattr(L, "DION_VERSION_MAJOR", 7)
    monkeypatch.setattr(L, "DION_VERSION_CODE", L.DION_VERSION(7, 2, 3))
    with pytest.raises(L.DionLibraryError) as ei:
        L.load_library(env={"LIBDION_PATH": libdion.library_path()})
    msg = str(ei.value)
    code = libdion.library_version()
    assert L.version_string(code) in msg and "7.2.3" in msg
    assert "major %d" % (code // 10000) in msg and "major 7" in msg


def test_struct_size_mismatch_is_rejected(monkeypatch):
    class Short(ctypes.Structure):
        _fields_ = [("struct_size", ctypes.c_size_t)]

    table = dict(L.SIZEOF_FUNCTIONS)
    table["dion_options_t"] = ("dion_options_sizeof", Short)
    monkeypatch.setattr(L, "SIZEOF_FUNCTIONS", table)
    with pytest.raises(L.DionLibraryError) as ei:
        L.load_library(env={"LIBDION_PATH": libdion.library_path()})
    assert "sizeof(dion_options_t)" in str(ei.value)


def test_search_order_package_then_build_tree_then_system():
    cands = L.candidates(env={})
    kinds = [k for k, _ in cands]
    # Kinds appear in the documented order, each as one contiguous run.
    order = [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]
    assert order == [k for k in ("package", "build", "system") if k in kinds]
    assert kinds[0] == "package" and kinds[-1] == "system"
    assert cands[-1][1] == "libdion.so.%d" % L.DION_VERSION_MAJOR
    assert all(os.path.dirname(p) == L.PACKAGE_DIR for k, p in cands if k == "package")
    if os.path.isdir(os.path.join(REPO_ROOT, "build")) and os.path.isfile(os.path.join(REPO_ROOT, "include",
                                                                                       "dion.h")):
        assert ("build", os.path.join(REPO_ROOT, "build", "libdion.so")) in cands
    assert L.candidates(env={"LIBDION_PATH": "/x/libdion.so"}) == [("env", "/x/libdion.so")]


def test_build_tree_walk_stops_at_the_repository_root(tmp_path):
    root = tmp_path / "repo"
    (root / "include").mkdir(parents=True)
    (root / "include" / "dion.h").write_text("")
    for b in ("build", "build-asan", "build-cuda"):
        (root / b).mkdir()
    pkg = root / "bindings" / "python" / "libdion"
    pkg.mkdir(parents=True)
    (tmp_path / "build").mkdir()  # above the root: must not be searched
    dirs = L._repo_build_dirs(str(pkg))
    assert dirs == [str(root / "build"), str(root / "build-asan"), str(root / "build-cuda")]
    outside = tmp_path / "elsewhere" / "libdion"
    outside.mkdir(parents=True)
    assert L._repo_build_dirs(str(outside)) == []


def test_python_dash_m_libdion_prints_path_and_versions():
    r = subprocess.run([sys.executable, "-m", "libdion", "--no-probe"], env=_child_env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert libdion.library_path() in r.stdout
    assert "library version: %s" % L.version_string(libdion.library_version()) in r.stdout
    assert "build features:" in r.stdout and "CUDA runtime" in r.stdout and "NCCL" in r.stdout


def test_python_dash_m_libdion_fails_with_diagnosis(tmp_path):
    bad = str(tmp_path / "libdion.so")
    r = subprocess.run([sys.executable, "-m", "libdion"], env=_child_env(LIBDION_PATH=bad), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1
    assert bad in r.stdout and "LD_LIBRARY_PATH" in r.stdout


def test_import_is_lazy_and_the_error_surfaces_at_first_use(tmp_path):
    code = ("import libdion\n"
            "try:\n"
            "    libdion.Optimizer()\n"
            "except libdion.DionLibraryError as e:\n"
            "    print('ERR', e)\n")
    bad = str(tmp_path / "missing.so")
    r = subprocess.run([sys.executable, "-c", code], env=_child_env(LIBDION_PATH=bad), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ERR") and bad in r.stdout
