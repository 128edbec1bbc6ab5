#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Checks bindings/julia/src/LibDion.jl against include/dion.h (Python 3 standard library only).

Julia is not available where libdion is built, so nothing runs the ccalls; this script checks them statically
by the C -> Julia table of bindings/julia/README.md:

  * every DION_API prototype of dion.h (multi-line ones included) has exactly one wrapper
        function <c_name>(<c parameter names>)
            @ccall $(sym(:<c_name>))(<name>::<JuliaType>, ...)::<JuliaType>
        end
    in header order, whose argument names, argument types and return type are those the table gives;
    no @ccall/ccall names anything else, and src/Dion.jl makes no ccall of its own;
  * every `typedef struct ... {fields} T;` has a Julia `struct` of the table's name with the same fields in the
    same order and the table's field types;
  * every enum constant and integer #define of the header is a `const` of the same value.

Exit status 0 when all hold, 1 listing every problem. `--self-test` breaks copies of LibDion.jl in memory in
several ways and fails unless each breakage is reported (the checker checking itself).
Usage: check_bindings.py [--header include/dion.h] [--libdion src/LibDion.jl] [--dion src/Dion.jl] [--self-test]
"""
import argparse
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# ---------------------------------------------------------------------------------------------------------------
# The C -> Julia table (README.md shows the same table)
# ---------------------------------------------------------------------------------------------------------------
SCALARS = {
    "int32_t": "Int32",
    "uint32_t": "UInt32",
    "int64_t": "Int64",
    "uint64_t": "UInt64",
    "size_t": "Csize_t",
    "double": "Cdouble",
}
VOIDP = "Ptr{Cvoid}"


def julia_struct_name(c_typedef):
    """dion_group_options_t -> DionGroupOptions."""
    core = re.sub(r"^dion_|_t$", "", c_typedef)
    return "Dion" + "".join(w[:1].upper() + w[1:] for w in core.split("_"))


# ---------------------------------------------------------------------------------------------------------------
# C header
# ---------------------------------------------------------------------------------------------------------------
# The header parse is shared with the other binding check (tools/dion_header.py).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
from dion_header import resolve  # noqa: E402
from dion_header import parse_header as _parse_header  # noqa: E402


def parse_header(path):
    return _parse_header(path, "check_bindings")


def julia_arg(h, ctype):
    const = ctype.startswith("const ")
    base = resolve(h, ctype)
    if base in SCALARS:
        return SCALARS[base]
    if base in h["handles"] or base == "void*" or re.match(r"^struct \w+\*$", base):
        return VOIDP
    if base.endswith("*"):
        pointee = resolve(h, base[:-1])
        if pointee == "char" and const:
            return "Cstring"
        if pointee in SCALARS:
            return "Ptr{%s}" % SCALARS[pointee]
        if pointee in h["handles"]:
            return "Ptr{Ptr{Cvoid}}"
        if pointee in h["structs"]:
            return "Ptr{%s}" % julia_struct_name(pointee)
    return None


def julia_ret(h, ctype):
    base = resolve(h, ctype)
    if base in SCALARS:
        return SCALARS[base]
    if base == "char*" and ctype.startswith("const "):
        return "Cstring"
    if base == "void":
        return "Cvoid"
    return None


def julia_field(h, ctype, dim):
    base = resolve(h, ctype)
    if dim:
        n = h["constants"].get(dim, None)
        if n is None and dim.isdigit():
            n = int(dim)
        elem = "UInt8" if base == "char" else SCALARS.get(base)
        return "NTuple{%d,%s}" % (n, elem) if elem and n is not None else None
    if base in SCALARS:
        return SCALARS[base]
    if base == "char*":
        return "Ptr{Cchar}"
    if base.endswith("*") or base in h["handles"]:
        return VOIDP
    return None


# ---------------------------------------------------------------------------------------------------------------
# Julia source
# ---------------------------------------------------------------------------------------------------------------
def strip_julia(text):
    """Blanks out comments (# ..., #= ... =#) and string contents, keeping offsets and newlines."""
    out, i, n = [], 0, len(text)

    def blank(s):
        return re.sub(r"[^\n]", " ", s)

    while i < n:
        if text.startswith("#=", i):
            j = text.find("=#", i + 2)
            j = n if j < 0 else j + 2
            out.append(blank(text[i:j]))
            i = j
        elif text[i] == "#":
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(blank(text[i:j]))
            i = j
        elif text.startswith('"""', i):
            j = text.find('"""', i + 3)
            j = n if j < 0 else j + 3
            out.append('"' + blank(text[i + 1:j - 1]) + '"')
            i = j
        elif text[i] == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            j = min(n, j + 1)
            out.append('"' + blank(text[i + 1:j - 1]) + '"')
            i = j
        elif text[i] == "'" and re.match(r"'(\\.|[^\\'])'", text[i:i + 4]):
            m = re.match(r"'(\\.|[^\\'])'", text[i:i + 4])
            out.append(" " * len(m.group(0)))
            i += len(m.group(0))
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def balanced(text, i, open_ch="(", close_ch=")"):
    """text[i] == open_ch; returns the index of the matching close_ch."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] in "({[":
            depth += 1
        elif text[j] in ")}]":
            depth -= 1
            if depth == 0:
                return j
    raise ValueError("unbalanced %s at offset %d" % (open_ch, i))


def split_top(s):
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur).strip())
    return parts


def norm_jtype(t):
    return re.sub(r"\s+", "", t)


def line_of(text, i):
    return text.count("\n", 0, i) + 1


def parse_libdion(text):
    code = strip_julia(text)
    j = {"wrappers": [], "raw_ccalls": [], "structs": {}, "constants": {}, "problems": []}
    for m in re.finditer(r"^\s*const\s+(DION_\w+)\s*=\s*(.+?)\s*$", code, re.M):
        j["constants"][m.group(1)] = m.group(2)
    for m in re.finditer(r"^struct\s+(\w+)\s*\n(.*?)^end\b", code, re.M | re.S):
        fields = []
        for line in m.group(2).split("\n"):
            fm = re.match(r"^\s*(\w+)\s*::\s*(.+?)\s*$", line)
            if fm:
                fields.append((fm.group(1), norm_jtype(fm.group(2))))
        j["structs"][m.group(1)] = fields
    for m in re.finditer(r"(?<![\w@])ccall\s*\(", code):
        j["raw_ccalls"].append(line_of(code, m.start()))
    funcs = [(m.start(), m.group(1), [a.strip() for a in m.group(2).split(",") if a.strip()])
             for m in re.finditer(r"^\s*function\s+(\w+)\s*\(([^)]*)\)", code, re.M)]
    for m in re.finditer(r"@ccall\b", code):
        at = line_of(code, m.start())
        rest = code[m.end():]
        pm = re.match(r"\s*\$\(\s*sym\(\s*:(\w+)\s*\)\s*\)\s*\(", rest)
        if not pm:
            j["problems"].append("line %d: @ccall not of the form @ccall $(sym(:name))(...)::T" % at)
            continue
        open_at = m.end() + pm.end() - 1
        close_at = balanced(code, open_at)
        args = []
        for a in split_top(code[open_at + 1:close_at]):
            am = re.match(r"^(\w+)\s*::\s*(.+)$", a, re.S)
            args.append((am.group(1), norm_jtype(am.group(2))) if am else (None, norm_jtype(a)))
        rm = re.match(r"\s*::\s*([\w.]+(?:\{[^\n]*?\})?)", code[close_at + 1:])
        ret = norm_jtype(rm.group(1)) if rm else None
        enclosing = [f for f in funcs if f[0] < m.start()]
        fname, fparams = (enclosing[-1][1], enclosing[-1][2]) if enclosing else (None, [])
        j["wrappers"].append({"symbol": pm.group(1), "args": args, "ret": ret, "function": fname,
                              "params": fparams, "line": at})
    return j


def check(h, j, dion_text=None):
    problems = list(j["problems"])
    for line in j["raw_ccalls"]:
        problems.append("LibDion.jl line %d: a plain ccall (every C call is one @ccall wrapper)" % line)
    if dion_text is not None:
        code = strip_julia(dion_text)
        for m in re.finditer(r"(?<![\w])(@ccall|ccall\s*\()", code):
            problems.append("Dion.jl line %d: calls C directly (go through LibDion)" % line_of(code, m.start()))

    cnames = [f[0] for f in h["functions"]]
    syms = [w["symbol"] for w in j["wrappers"]]
    for name in cnames:
        if syms.count(name) == 0:
            problems.append("%s: no wrapper" % name)
        elif syms.count(name) > 1:
            problems.append("%s: %d wrappers (expected exactly one)" % (name, syms.count(name)))
    for name in sorted(set(syms) - set(cnames)):
        problems.append("%s: wrapped but not a function of dion.h (bind nothing outside the header)" % name)
    seen = [s for s in dict.fromkeys(syms) if s in cnames]
    if seen != [n for n in cnames if n in seen]:
        problems.append("wrappers are not in header order")

    by_sym = {}
    for w in j["wrappers"]:
        by_sym.setdefault(w["symbol"], w)
    for cname, cret, cparams in h["functions"]:
        w = by_sym.get(cname)
        if w is None:
            continue
        where = "%s (LibDion.jl line %d)" % (cname, w["line"])
        if w["function"] != cname:
            problems.append("%s: the @ccall is in function %s, expected function %s" % (where, w["function"], cname))
        want_names = [p[1] for p in cparams]
        if w["params"] != want_names:
            problems.append("%s: function parameters (%s) differ from the C parameters (%s)"
                            % (where, ", ".join(w["params"]), ", ".join(want_names)))
        if len(w["args"]) != len(cparams):
            problems.append("%s: %d @ccall arguments, the C function has %d" % (where, len(w["args"]), len(cparams)))
        for (ctype, pname), (aname, atype) in zip(cparams, w["args"]):
            want = julia_arg(h, ctype)
            if want is None:
                problems.append("%s: C type %r of %s has no entry in the table" % (where, ctype, pname))
            elif atype != want:
                problems.append("%s: argument %s is %s::%s, the table says %s for %s"
                                % (where, pname, aname, atype, want, ctype))
            if aname != pname:
                problems.append("%s: argument %s passes %r" % (where, pname, aname))
        want = julia_ret(h, cret)
        if want is None:
            problems.append("%s: C return type %r has no entry in the table" % (where, cret))
        elif w["ret"] != want:
            problems.append("%s: returns ::%s, the table says %s for %s" % (where, w["ret"], want, cret))

    for sname, fields in h["structs"].items():
        jname = julia_struct_name(sname)
        jf = j["structs"].get(jname)
        if jf is None:
            problems.append("struct %s: no Julia struct %s" % (sname, jname))
            continue
        jnames, cfields = [f[0] for f in jf], [f[1] for f in fields]
        if jnames != cfields:
            k = next((i for i, (a, b) in enumerate(zip(jnames, cfields)) if a != b), min(len(jnames), len(cfields)))
            problems.append("struct %s: %s field %d is %s, C's is %s (%d fields in Julia, %d in C)"
                            % (sname, jname, k + 1, jnames[k] if k < len(jnames) else "(none)",
                               cfields[k] if k < len(cfields) else "(none)", len(jnames), len(cfields)))
            continue
        for (ctype, fname, dim), (_, jtype) in zip(fields, jf):
            want = julia_field(h, ctype, dim)
            if want is None:
                problems.append("struct %s: C field type %r of %s has no entry in the table" % (sname, ctype, fname))
            elif jtype != want:
                problems.append("struct %s: %s.%s is %s, the table says %s for %s%s"
                                % (sname, jname, fname, jtype, want, ctype, "[%s]" % dim if dim else ""))

    for cname, value in h["constants"].items():
        got = j["constants"].get(cname)
        if got is None:
            problems.append("constant %s = %d: no const in LibDion.jl" % (cname, value))
            continue
        m = re.match(r"^(?:Int32\()?\s*(-?\d+)\s*\)?$", got)
        if not m:
            problems.append("constant %s: %r is not an Int32 literal" % (cname, got))
        elif int(m.group(1)) != value:
            problems.append("constant %s: Julia %s, C %d" % (cname, m.group(1), value))
    return problems


# ---------------------------------------------------------------------------------------------------------------
# Self-test: each breakage of a correct LibDion.jl must be reported.
# ---------------------------------------------------------------------------------------------------------------
BREAKAGES = [
    ("size_t as Cint (NCCL.jl's config drift)", "count::Csize_t", "count::Cint"),
    ("int64_t as Int32", "step::Int64)::Int32", "step::Int32)::Int32"),
    ("a handle passed by value where C takes a pointer to it",
     "optimizer::Ptr{Ptr{Cvoid}}, options::Ptr{DionOptions}", "optimizer::Ptr{Cvoid}, options::Ptr{DionOptions}"),
    ("a wrong return type", "dion_options_sizeof))()::Csize_t", "dion_options_sizeof))()::Int32"),
    ("a swapped argument pair",
     "(optimizer::Ptr{Cvoid}, index::Int32, info::Ptr{DionStateInfo})",
     "(optimizer::Ptr{Cvoid}, info::Ptr{DionStateInfo}, index::Int32)"),
    ("a missing argument", "last_skipped::Ptr{Int32},", ""),
    ("const char* as Ptr{Cvoid}", "name::Cstring, index::Ptr{Int32}", "name::Ptr{Cvoid}, index::Ptr{Int32}"),
    ("a struct field of the wrong width", "    ndim::Int32\n    shape::", "    ndim::Int64\n    shape::"),
    ("two struct fields swapped", "    fraction::Cdouble\n    ef_decay::Cdouble\n",
     "    ef_decay::Cdouble\n    fraction::Cdouble\n"),
    ("a wrong constant", "const DION_HPARAM_EF_DECAY = Int32(6)", "const DION_HPARAM_EF_DECAY = Int32(5)"),
    ("a wrapper calling another symbol", "$(sym(:dion_tensor_count))", "$(sym(:dion_group_count))"),
    ("an extra binding outside the header", "end # module LibDion",
     "function dion_extra()\n    @ccall $(sym(:dion_extra))()::Int32\nend\nend # module LibDion"),
]


def self_test(h, text, dion_text):
    base = check(h, parse_libdion(text), dion_text)
    if base:
        print("check_bindings --self-test: the unbroken bindings already have problems:")
        for p in base:
            print("  - " + p)
        return 1
    failed = 0
    for what, old, new in BREAKAGES:
        if old not in text:
            print("  [self-test] cannot apply %r: text not found" % what)
            failed += 1
            continue
        found = check(h, parse_libdion(text.replace(old, new, 1)), dion_text)
        print("  [self-test] %-58s -> %s" % (what, ("caught: " + found[0]) if found else "NOT CAUGHT"))
        failed += 0 if found else 1
    broken_dion = dion_text + "\nf() = @ccall $(LibDion.sym(:dion_version))()::Int32\n"
    found = check(h, parse_libdion(text), broken_dion)
    print("  [self-test] %-58s -> %s" % ("a ccall in Dion.jl", ("caught: " + found[0]) if found else "NOT CAUGHT"))
    failed += 0 if found else 1
    print("check_bindings --self-test: %d of %d breakages caught"
          % (len(BREAKAGES) + 1 - failed, len(BREAKAGES) + 1))
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------------------------
# --abi: run the Julia declarations against a built libdion through ctypes
# ---------------------------------------------------------------------------------------------------------------
def abi_run(h, j, libpath):
    """Builds ctypes structs and signatures from LibDion.jl's *Julia* types (not from the header) and runs a
    small scenario: struct sizes and *_init defaults, create, a rejected negative lr with its message, a Muon
    group on a column-major matrix, a step, state info/find/read, hparams and step counters. A wrong Julia type
    shows up as a wrong size, a garbled field or a failing call. Returns a list of problems."""
    import ctypes as C
    scal = {"Int32": C.c_int32, "UInt32": C.c_uint32, "Int64": C.c_int64, "UInt64": C.c_uint64,
            "Csize_t": C.c_size_t, "Cdouble": C.c_double, "UInt8": C.c_uint8, "Cchar": C.c_char}

    def ctype_of(jt, structs):
        if jt in scal:
            return scal[jt]
        if jt == "Cstring":
            return C.c_char_p
        if jt.startswith("Ptr{"):
            return C.c_void_p
        m = re.match(r"^NTuple\{(\d+),(\w+)\}$", jt)
        if m:
            return scal[m.group(2)] * int(m.group(1))
        if jt in structs:
            return structs[jt]
        raise ValueError("no ctypes type for Julia type %s" % jt)

    structs = {}
    for name, fields in j["structs"].items():
        structs[name] = type(name, (C.Structure,), {"_fields_": [(f, ctype_of(t, structs)) for f, t in fields]})
    lib = C.CDLL(libpath)
    fn = {}
    for w in j["wrappers"]:
        f = getattr(lib, w["symbol"])
        f.argtypes = [ctype_of(t, structs) for _, t in w["args"]]
        f.restype = None if w["ret"] == "Cvoid" else ctype_of(w["ret"], structs)
        fn[w["symbol"]] = f
    problems = []

    def expect(cond, what):
        if not cond:
            problems.append("abi: " + what)

    def ok(status, what, handle=None):
        if status != 0:
            msg = fn["dion_last_error"](handle).decode()
            problems.append("abi: %s returned %d: %s" % (what, status, msg))
        return status == 0

    S = {n: structs[julia_struct_name(n)] for n in h["structs"]}
    for cname in ("dion_options_t", "dion_tensor_t", "dion_group_options_t"):
        got, want = C.sizeof(S[cname]), fn[re.sub(r"_t$", "_sizeof", cname)]()
        expect(got == want, "sizeof(%s) = %d, the library's is %d" % (julia_struct_name(cname), got, want))
    expect(C.sizeof(S["dion_nccl_unique_id_t"]) == 128, "sizeof(DionNcclUniqueId) != 128")
    expect(fn["dion_version"]() // 10000 == h["constants"]["DION_VERSION_MAJOR"], "major version differs")
    expect(b"invalid argument" in fn["dion_status_string"](1), "dion_status_string(1)")

    o = S["dion_options_t"]()
    ok(fn["dion_options_init"](C.byref(o)), "dion_options_init")
    expect((o.struct_size, o.abi_version, o.backend, o.replicate_grad_sync, o.skip_nonfinite, o.seed) ==
           (C.sizeof(o), 1, 0, 1, 1, 0), "DionOptions defaults read back wrong")
    g = S["dion_group_options_t"]()
    ok(fn["dion_group_options_init"](C.byref(g), h["constants"]["DION_ALGO_MUON"]), "dion_group_options_init")
    expect((g.algorithm, g.lr, g.mu, g.beta2, g.epsilon, g.cqr_warmup_steps, g.oversample, g.ortho_steps,
            g.fraction, g.muon_beta2, g.momentum_dtype, g.matmul_precision) ==
           (2, 0.01, 0.95, 0.95, 1e-8, 150, 1.25, 5, 0.25, 0.95, -1, 0), "DionGroupOptions defaults read back wrong")
    t = S["dion_tensor_t"]()
    ok(fn["dion_tensor_init"](C.byref(t)), "dion_tensor_init")
    expect((t.struct_size, t.grad_dtype, t.outer_shard_dim, t.inner_shard_dim) == (C.sizeof(t), -1, -1, -1),
           "DionTensor defaults read back wrong")

    opt = C.c_void_p()
    if not ok(fn["dion_create"](C.byref(opt), C.byref(o)), "dion_create"):
        return problems
    try:
        m, n = 12, 8
        W = (C.c_float * (m * n))(*[((i * 37) % 11 - 5) / 7.0 for i in range(m * n)])
        G = (C.c_float * (m * n))(*[((i * 13) % 7 - 3) / 5.0 for i in range(m * n)])
        W0 = list(W)
        name = C.create_string_buffer(b"W")
        t.name, t.param, t.grad = C.cast(name, C.c_void_p), C.cast(W, C.c_void_p), C.cast(G, C.c_void_p)
        t.param_dtype, t.layout, t.ndim = 0, 1, 2
        t.shape[0], t.shape[1] = m, n
        gi = C.c_int32(-1)
        g.lr = -1.0
        st = fn["dion_add_group"](opt, C.byref(g), C.byref(t), 1, C.byref(gi))
        msg = fn["dion_last_error"](opt).decode()
        expect(st == 1 and "lr" in msg, "negative lr: status %d, message %r" % (st, msg))
        g.lr = 0.02
        ok(fn["dion_add_group"](opt, C.byref(g), C.byref(t), 1, C.byref(gi)), "dion_add_group", opt)
        cnt = C.c_int32(0)
        ok(fn["dion_tensor_count"](opt, C.byref(cnt)), "dion_tensor_count", opt)
        expect((gi.value, cnt.value) == (0, 1), "group index / tensor count after one group")
        ok(fn["dion_step"](opt, None), "dion_step", opt)
        expect(list(W) != W0, "dion_step did not change the parameter")
        step = C.c_int64(0)
        ok(fn["dion_group_get_step"](opt, 0, C.byref(step)), "dion_group_get_step", opt)
        expect(step.value == 1, "step counter %d after one step" % step.value)
        ok(fn["dion_group_set_hparam"](opt, 0, h["constants"]["DION_HPARAM_LR"], 0.125), "set_hparam", opt)
        v = C.c_double(0)
        ok(fn["dion_group_get_hparam"](opt, 0, h["constants"]["DION_HPARAM_LR"], C.byref(v)), "get_hparam", opt)
        expect(v.value == 0.125, "hparam round trip gave %r" % v.value)
        idx = C.c_int32(-1)
        ok(fn["dion_state_find"](opt, 0, b"momentum", C.byref(idx)), "dion_state_find", opt)
        info = S["dion_state_info_t"]()
        info.struct_size = C.sizeof(info)
        ok(fn["dion_state_info"](opt, idx.value, C.byref(info)), "dion_state_info", opt)
        expect((C.string_at(info.name), info.tensor, info.layout, info.ndim, tuple(info.global_shape)[:2],
                info.local_bytes) == (b"momentum", 0, 1, 2, (m, n), 4 * m * n), "DionStateInfo read back wrong")
        M = (C.c_float * (m * n))()
        ok(fn["dion_state_read"](opt, idx.value, C.cast(M, C.c_void_p), C.sizeof(M), None), "dion_state_read", opt)
        expect(any(x != 0 for x in M), "momentum is zero after a step")
        sk, last = C.c_int64(-1), C.c_int32(-1)
        ok(fn["dion_get_skipped_steps"](opt, C.byref(sk), C.byref(last), None), "dion_get_skipped_steps", opt)
        expect((sk.value, last.value) == (0, 0), "skipped steps")
        a, b = C.c_uint64(1), C.c_uint64(1)
        ok(fn["dion_get_comm_bytes"](opt, 0, C.byref(a), C.byref(b)), "dion_get_comm_bytes", opt)
        expect((a.value, b.value) == (0, 0), "comm bytes without meshes")
    finally:
        ok(fn["dion_destroy"](opt), "dion_destroy")
    return problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--header", default=os.path.join(ROOT, "include", "dion.h"))
    ap.add_argument("--libdion", default=os.path.join(HERE, "src", "LibDion.jl"))
    ap.add_argument("--dion", default=os.path.join(HERE, "src", "Dion.jl"))
    ap.add_argument("--self-test", action="store_true")
    ap.add_argument("--abi", metavar="LIBDION_SO", help="also run LibDion.jl's declarations against this library")
    a = ap.parse_args()
    h = parse_header(a.header)
    text = open(a.libdion).read()
    dion_text = open(a.dion).read() if os.path.exists(a.dion) else None
    if a.self_test:
        return self_test(h, text, dion_text or "")
    j = parse_libdion(text)
    problems = check(h, j, dion_text)
    if a.abi and not problems:
        problems = abi_run(h, j, a.abi)
        if not problems:
            print("check_bindings: LibDion.jl's structs and signatures ran a create/add/step/state scenario "
                  "against %s through ctypes" % a.abi)
    if problems:
        print("check_bindings: %d problem(s) in %s:" % (len(problems), a.libdion))
        for p in problems:
            print("  - " + p)
        return 1
    print("check_bindings: %d functions, %d structs, %d constants of %s match %s"
          % (len(h["functions"]), len(h["structs"]), len(h["constants"]), os.path.basename(a.header),
             os.path.basename(a.libdion)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
