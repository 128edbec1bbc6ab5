# SPDX-License-Identifier: MIT
"""PEP 517 / PEP 660 build backend of the libdion binding that works offline.

pip builds in an isolated environment and would download whatever
``[build-system] requires`` names; there is no package index on an offline
machine, so this backend requires nothing:

* when setuptools is importable (``pip install --no-build-isolation``, or any
  caller that has it) every hook is delegated to ``setuptools.build_meta``,
  which reads the ``[project]`` and ``[tool.setuptools]`` tables of
  pyproject.toml;
* otherwise (plain ``pip install ./bindings/python``, where pip hides the
  system site-packages) it writes the same pure-Python wheel with the
  standard library: the ``libdion`` package (plus a ``libdion.so*`` placed in
  it, if any) and its ``.dist-info``.
"""
import base64
import hashlib
import io
import os
import re
import tarfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))

try:
    from setuptools import build_meta as _setuptools
    import setuptools as _st_mod

    if int(_st_mod.__version__.split(".")[0]) < 61:  # no [project] table support before 61
        _setuptools = None
except ImportError:
    _setuptools = None


def _project():
    with open(os.path.join(HERE, "pyproject.toml"), "rb") as f:
        text = f.read().decode()
    try:
        import tomllib

        proj = tomllib.loads(text)["project"]
    except ImportError:  # Python < 3.11: the few keys used here, by pattern
        proj = {k: v for k, v in re.findall(r'^(name|version|description|requires-python)\s*=\s*"([^"]*)"', text,
                                            re.M)}
        proj["optional-dependencies"] = {}
    return proj


def _metadata(proj):
    lines = ["Metadata-Version: 2.1", "Name: %s" % proj["name"], "Version: %s" % proj["version"],
             "Summary: %s" % proj.get("description", ""), "License: MIT"]
    if proj.get("requires-python"):
        lines.append("Requires-Python: %s" % proj["requires-python"])
    for extra, reqs in sorted(proj.get("optional-dependencies", {}).items()):
        lines.append("Provides-Extra: %s" % extra)
        lines += ['Requires-Dist: %s; extra == "%s"' % (r, extra) for r in reqs]
    readme = os.path.join(HERE, "README.md")
    body = ""
    if os.path.isfile(readme):
        lines.append("Description-Content-Type: text/markdown")
        with open(readme) as f:
            body = "\n" + f.read()
    return "\n".join(lines) + "\n" + body


def _package_files():
    pkg = os.path.join(HERE, "libdion")
    out = []
    for name in sorted(os.listdir(pkg)):
        full = os.path.join(pkg, name)
        if os.path.isfile(full) and (name.endswith(".py") or name.startswith("libdion.so")):
            out.append(("libdion/" + name, full))
    return out


def _dist_info(proj):
    return "%s-%s.dist-info" % (proj["name"].replace("-", "_"), proj["version"])


def _write_wheel(wheel_directory, files_and_data, proj):
    """files_and_data: list of (archive name, bytes). Returns the wheel's file name."""
    tag = "py3-none-any"
    name = "%s-%s-%s.whl" % (proj["name"].replace("-", "_"), proj["version"], tag)
    di = _dist_info(proj)
    entries = list(files_and_data)
    entries.append((di + "/METADATA", _metadata(proj).encode()))
    entries.append((di + "/WHEEL", ("Wheel-Version: 1.0\nGenerator: _libdion_build\nRoot-Is-Purelib: true\n"
                                    "Tag: %s\n" % tag).encode()))
    entries.append((di + "/top_level.txt", b"libdion\n"))
    record = []
    for arc, data in entries:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append("%s,sha256=%s,%d" % (arc, digest, len(data)))
    record.append(di + "/RECORD,,")
    entries.append((di + "/RECORD", ("\n".join(record) + "\n").encode()))
    os.makedirs(wheel_directory, exist_ok=True)
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w", zipfile.ZIP_DEFLATED) as z:
        for arc, data in entries:
            info = zipfile.ZipInfo(arc, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = (0o755 if ".so" in arc else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
    return name


def _read(path):
    with open(path, "rb") as f:
        return f.read()


# ---- PEP 517 hooks ----

def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) if _setuptools else []


def get_requires_for_build_sdist(config_settings=None):
    return _setuptools.get_requires_for_build_sdist(config_settings) if _setuptools else []


def get_requires_for_build_editable(config_settings=None):
    if _setuptools and hasattr(_setuptools, "get_requires_for_build_editable"):
        return _setuptools.get_requires_for_build_editable(config_settings)
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    if _setuptools:
        return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)
    proj = _project()
    return _write_wheel(wheel_directory, [(arc, _read(full)) for arc, full in _package_files()], proj)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    if _setuptools and hasattr(_setuptools, "build_editable"):
        return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
    proj = _project()
    # A .pth file puts this source directory on sys.path: edits and a libdion.so
    # found through the build tree (the loader's third candidate) both work.
    return _write_wheel(wheel_directory, [("__editable__.libdion.pth", (HERE + "\n").encode())], proj)


def build_sdist(sdist_directory, config_settings=None):
    if _setuptools:
        return _setuptools.build_sdist(sdist_directory, config_settings)
    proj = _project()
    base = "%s-%s" % (proj["name"], proj["version"])
    files = [("pyproject.toml", os.path.join(HERE, "pyproject.toml")),
             ("_libdion_build.py", os.path.join(HERE, "_libdion_build.py")),
             ("README.md", os.path.join(HERE, "README.md"))]
    files += [(arc, full) for arc, full in _package_files() if not arc.endswith((".so",)) and ".so." not in arc]
    name = base + ".tar.gz"
    os.makedirs(sdist_directory, exist_ok=True)
    with tarfile.open(os.path.join(sdist_directory, name), "w:gz", format=tarfile.PAX_FORMAT) as tar:
        pkg_info = _metadata(proj).encode()
        ti = tarfile.TarInfo(base + "/PKG-INFO")
        ti.size = len(pkg_info)
        tar.addfile(ti, io.BytesIO(pkg_info))
        for arc, full in files:
            if os.path.isfile(full):
                tar.add(full, arcname=base + "/" + arc)
    return name
