# SPDX-License-Identifier: MIT
"""The ctypes mirror against include/dion.h: constants, struct layouts, the function table."""
import ctypes
import os
import re
import shutil
import subprocess

import pytest

import libdion
from libdion import _lib as L
from conftest import HEADER, MPI_HEADER, REPO_ROOT

STRUCTS = {
    "dion_options_t": L.dion_options_t,
    "dion_tensor_t": L.dion_tensor_t,
    "dion_group_options_t": L.dion_group_options_t,
    "dion_state_info_t": L.dion_state_info_t,
    "dion_nccl_unique_id_t": L.dion_nccl_unique_id_t,
}


@pytest.mark.parametrize("sname", sorted(L.SIZEOF_FUNCTIONS))
def test_struct_size_equals_library_sizeof(lib, sname):
    fname, cls = L.SIZEOF_FUNCTIONS[sname]
    assert ctypes.sizeof(cls) == getattr(lib, fname)()


def test_unsized_structs_have_their_documented_size():
    assert ctypes.sizeof(L.dion_nccl_unique_id_t) == L.DION_NCCL_UNIQUE_ID_BYTES == 128
    # size_t, 2 x int32, pointer, 3 x int32 (+4 padding), 3 x int64[4], uint64 on LP64.
    if ctypes.sizeof(ctypes.c_void_p) == 8:
        assert ctypes.sizeof(L.dion_state_info_t) == 144


def test_every_constant_matches_the_header(header_text):
    enum_vals = dict((n, int(v)) for n, v in re.findall(r"^\s*(DION_[A-Z0-9_]+)\s*=\s*(-?\d+)", header_text, re.M))
    assert len(enum_vals) >= 52  # statuses, dtypes, backends, algorithms, ... hparams
    for name, value in enum_vals.items():
        assert getattr(L, name) == value, name
    defines = dict(re.findall(r"^#define\s+(DION_[A-Z0-9_]+)\s+\(?(-?\d+)\)?\s*$", header_text, re.M))
    for name in ("DION_VERSION_MAJOR", "DION_VERSION_MINOR", "DION_VERSION_PATCH", "DION_ABI_VERSION",
                 "DION_NCCL_UNIQUE_ID_BYTES", "DION_MAX_DIMS"):
        assert getattr(L, name) == int(defines[name]), name
    assert L.DION_UNSET_INT == -2147483648
    assert "#define DION_UNSET_INT (-2147483647 - 1)" in header_text


def _header_prototypes(*paths):
    protos = {}
    for p in paths:
        if not os.path.isfile(p):
            continue
        text = open(p).read()
        text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
        for m in re.finditer(r"DION_API\s+([^;]*?)\b(dion_[a-z0-9_]+)\s*\(([^)]*)\)\s*;", text, re.S):
            ret, name, args = m.group(1).strip(), m.group(2), " ".join(m.group(3).split())
            protos[name] = (ret, [] if args in ("void", "") else [a.strip() for a in args.split(",")])
    return protos


def test_function_table_covers_every_prototype_in_the_headers(header_text):
    protos = _header_prototypes(HEADER, MPI_HEADER)
    table = dict(L._FUNCTIONS)
    table.update(L._OPTIONAL_FUNCTIONS)
    assert set(protos) == set(table)
    for name, (ret, args) in protos.items():
        restype, argtypes = table[name]
        assert len(argtypes) == len(args), name
        if ret.startswith("const char"):
            assert restype is ctypes.c_char_p, name
        elif ret == "size_t":
            assert restype is ctypes.c_size_t, name
        else:
            assert restype is ctypes.c_int32, name  # dion_status_t and int32_t
        for a, t in zip(args, argtypes):
            if "*" in a or a.startswith(("dion_comm_t", "dion_optimizer_t", "dion_stream_t", "MPI_Comm")):
                ok = t is ctypes.c_void_p or t is ctypes.c_char_p or hasattr(t, "_type_") and \
                    issubclass(t, ctypes._Pointer)
                assert ok, (name, a, t)
            elif a.startswith("double"):
                assert t is ctypes.c_double, (name, a)
            elif a.startswith(("int64_t", "uint64_t")):
                assert ctypes.sizeof(t) == 8, (name, a)
            elif a.startswith("size_t"):
                assert t is ctypes.c_size_t, (name, a)
            else:
                assert ctypes.sizeof(t) == 4, (name, a)


def test_every_exported_symbol_has_its_prototype_set(lib):
    nm = shutil.which("nm")
    exported = None
    if nm:
        r = subprocess.run([nm, "-D", "--defined-only", libdion.library_path()], capture_output=True, text=True)
        if r.returncode == 0:
            exported = {ln.split()[-1] for ln in r.stdout.splitlines() if ln.split() and
                        ln.split()[-1].startswith("dion_")}
    if exported is None:
        exported = set(L._FUNCTIONS)
    known = set(L._FUNCTIONS) | set(L._OPTIONAL_FUNCTIONS)
    assert exported <= known, "exported but not bound: %s" % sorted(exported - known)
    for name in exported:
        restype, argtypes = (L._FUNCTIONS.get(name) or L._OPTIONAL_FUNCTIONS[name])
        fn = getattr(lib, name)
        assert fn.restype is restype and list(fn.argtypes) == list(argtypes), name
    assert lib.dion_last_error.restype is ctypes.c_char_p
    assert lib.dion_status_string.restype is ctypes.c_char_p
    assert lib.dion_status_string(L.DION_ERROR_INVALID_ARGUMENT).startswith(b"invalid argument")
    assert lib.dion_status_string(999) == b"unknown status"


def test_struct_field_offsets_match_a_c_compiler(tmp_path, header_text):
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler")
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "dion.h"', "int main(void) {"]
    for sname, cls in STRUCTS.items():
        lines.append('  printf("%s sizeof %%zu\\n", sizeof(%s));' % (sname, sname))
        for fname, _ in cls._fields_:
            lines.append('  printf("%s %s %%zu %%zu\\n", offsetof(%s, %s), sizeof(((%s*)0)->%s));' %
                         (sname, fname, sname, fname, sname, fname))
    lines += ["  return 0;", "}"]
    src = tmp_path / "offsets.c"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "offsets"
    r = subprocess.run([cc, "-std=c99", "-I", os.path.join(REPO_ROOT, "include"), str(src), "-o", str(exe)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split("\n")
    seen = 0
    for ln in out:
        parts = ln.split()
        if len(parts) == 3 and parts[1] == "sizeof":
            assert ctypes.sizeof(STRUCTS[parts[0]]) == int(parts[2]), ln
            seen += 1
        elif len(parts) == 4:
            cls = STRUCTS[parts[0]]
            field = getattr(cls, parts[1])
            assert (field.offset, field.size) == (int(parts[2]), int(parts[3])), ln
            seen += 1
    assert seen == sum(len(c._fields_) + 1 for c in STRUCTS.values())


def test_init_functions_fill_struct_size_and_abi_version(lib):
    o = L.dion_options_t()
    assert lib.dion_options_init(ctypes.byref(o)) == 0
    assert (o.struct_size, o.abi_version, o.skip_nonfinite, o.replicate_grad_sync) == (
        ctypes.sizeof(o), L.DION_ABI_VERSION, 1, 1)
    t = L.dion_tensor_t()
    assert lib.dion_tensor_init(ctypes.byref(t)) == 0
    assert (t.struct_size, t.grad_dtype, t.outer_shard_dim, t.inner_shard_dim) == (ctypes.sizeof(t),
                                                                                   L.DION_DTYPE_UNSET, -1, -1)
    g = L.dion_group_options_t()
    assert lib.dion_group_options_init(ctypes.byref(g), L.DION_ALGO_DION) == 0
    assert (g.struct_size, g.abi_version, g.lr, g.mu, g.beta2, g.oversample, g.ortho_steps) == (
        ctypes.sizeof(g), L.DION_ABI_VERSION, 0.01, 0.95, 0.95, 1.25, 5)
