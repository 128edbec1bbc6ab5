#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Checks bindings/fortran/dion.f90 against include/dion.h (Python 3 standard library only).

A Fortran compiler cannot compare a bind(C) interface with the C prototype: a forgotten VALUE or a wrong kind
compiles and then corrupts arguments at run time. This script applies the C -> Fortran table of README.md:

  * every DION_API function of dion.h has exactly one bind(C) interface, in header order, whose Fortran name
    and bind name are the C name, whose dummies carry the C parameter names in C order, and whose dummy and
    result declarations are those the table gives for the C types; nothing else in the file is bind(C) to a
    function (bind nothing outside the table);
  * every `typedef struct ... {fields} T;` has a `type, bind(C) :: T` with the same components in the same
    order, each declared as the table says;
  * every enum constant and integer #define of the header has an integer(c_int32_t) parameter of the same value.

Exit status 0 when all hold, 1 (listing every problem) otherwise.
Usage: check_interfaces.py [--header include/dion.h] [--module bindings/fortran/dion.f90]
"""
import argparse
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# ---------------------------------------------------------------------------------------------------------------
# The C -> Fortran table (README.md shows the same table). Scalar C types by value, by pointer, and as fields.
# ---------------------------------------------------------------------------------------------------------------
SCALARS = {
    "int32_t": "integer(c_int32_t)",
    "uint32_t": "integer(c_int32_t)",  # Fortran has no unsigned integers: same bits, values < 2**31
    "int64_t": "integer(c_int64_t)",
    "uint64_t": "integer(c_int64_t)",  # same bits; byte counts < 2**63
    "size_t": "integer(c_size_t)",
    "double": "real(c_double)",
}
C_PTR = "type(c_ptr)"
# Structs passed by non-const pointer that the caller partly fills (info->struct_size) -> intent(inout);
# the other non-const struct pointers are pure outputs (the *_init functions, dion_nccl_get_unique_id).
INOUT_STRUCTS = {"dion_state_info_t"}


# ---------------------------------------------------------------------------------------------------------------
# C header
# ---------------------------------------------------------------------------------------------------------------
# The header parse is shared with the other binding check (tools/dion_header.py).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
from dion_header import resolve  # noqa: E402
from dion_header import parse_header as _parse_header  # noqa: E402


def parse_header(path):
    return _parse_header(path, "check_interfaces")


def expected_dummy(h, ctype, next_ctype):
    const = ctype.startswith("const ")
    base = resolve(h, ctype)
    if base in SCALARS:
        return (SCALARS[base], frozenset(["value"]), None)
    if base in h["handles"] or base in ("void*",) or re.match(r"^struct \w+\*$", base):
        return (C_PTR, frozenset(["value"]), None)
    if base.endswith("*"):
        pointee = resolve(h, base[:-1])
        if pointee in SCALARS and not const:
            return (SCALARS[pointee], frozenset(["intent(out)"]), None)
        if pointee in h["handles"] and not const:
            return (C_PTR, frozenset(["intent(out)"]), None)
        if pointee == "char" and const:
            return ("character(kind=c_char)", frozenset(["intent(in)"]), "*")
        if pointee in h["structs"]:
            if const:
                # A const struct pointer followed by a size_t count is an array of `count` structs.
                dims = "*" if next_ctype is not None and resolve(h, next_ctype) == "size_t" else None
                return ("type(%s)" % pointee, frozenset(["intent(in)"]), dims)
            intent = "intent(inout)" if pointee in INOUT_STRUCTS else "intent(out)"
            return ("type(%s)" % pointee, frozenset([intent]), None)
    return None


def expected_result(h, ctype):
    base = resolve(h, ctype)
    if base in SCALARS:
        return (SCALARS[base], frozenset(), None)
    if base == "char*" and ctype.startswith("const "):
        return (C_PTR, frozenset(), None)
    return None


def expected_field(h, ctype, dim):
    base = resolve(h, ctype)
    if base in SCALARS:
        spec = SCALARS[base]
    elif base.endswith("*") or base in h["handles"]:
        spec = C_PTR
    elif base == "char":
        spec = "character(kind=c_char)"
    else:
        return None
    return (spec, frozenset(), dim.lower() if dim else None)


# ---------------------------------------------------------------------------------------------------------------
# Fortran source
# ---------------------------------------------------------------------------------------------------------------
def fortran_lines(path):
    """Logical lines: comments removed, continuations joined, lower case (bind names keep their case)."""
    out, pending = [], ""
    for line in open(path):
        code, quote = [], None
        for ch in line.rstrip("\n"):
            if quote:
                code.append(ch)
                if ch == quote:
                    quote = None
            elif ch in "\"'":
                quote = ch
                code.append(ch)
            elif ch == "!":
                break
            else:
                code.append(ch)
        code = "".join(code).strip()
        if pending:
            code = code[1:].strip() if code.startswith("&") else code
            code = pending + " " + code
            pending = ""
        if code.endswith("&"):
            pending = code[:-1].rstrip()
            continue
        if code:
            out.append(code)
    return out


def split_top(s):
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur).strip())
    return parts


def parse_decl(line):
    """'integer(c_int32_t), value :: a, b(*)' -> {name: (typespec, attrs, dims)}; None if not a declaration."""
    if "::" not in line:
        return None
    left, right = line.split("::", 1)
    items = [re.sub(r"\s+", "", x) for x in split_top(left.lower())]
    spec, attrs = items[0], frozenset(items[1:])
    decls = {}
    for ent in split_top(right.lower()):
        m = re.match(r"^(\w+)\s*(?:\((.*)\))?$", ent.strip())
        if m:
            decls[m.group(1)] = (spec, attrs, re.sub(r"\s+", "", m.group(2)) if m.group(2) else None)
    return decls


def parse_module(path):
    lines = fortran_lines(path)
    f = {"interfaces": [], "types": {}, "parameters": {}, "other_binds": []}
    i = 0
    while i < len(lines):
        low = lines[i].lower()
        m = re.match(r"^function\s+(\w+)\s*\(([^)]*)\)\s*bind\s*\(\s*c\s*,\s*name\s*=\s*[\"'](\w+)[\"']\s*\)\s*$", low)
        mt = re.match(r"^type\s*,\s*bind\s*\(\s*c\s*\)\s*(?:,\s*\w+\s*)?::\s*(\w+)$", low)
        if m:
            name, dummies = m.group(1), [d.strip() for d in m.group(2).split(",") if d.strip()]
            bind = re.search(r"name\s*=\s*[\"'](\w+)[\"']", lines[i]).group(1)
            decls = {}
            i += 1
            while not re.match(r"^end\s*function", lines[i].lower()):
                d = parse_decl(lines[i])
                if d and not lines[i].lower().startswith("import"):
                    decls.update(d)
                i += 1
            f["interfaces"].append((name, bind, dummies, decls))
        elif mt:
            comps = []
            i += 1
            while not re.match(r"^end\s*type", lines[i].lower()):
                d = parse_decl(lines[i])
                if d:
                    comps.extend(d.items())
                i += 1
            f["types"][mt.group(1)] = comps
        elif re.search(r"\bbind\s*\(\s*c\b", low):
            f["other_binds"].append(lines[i])
        elif re.match(r"^integer\s*\(\s*c_int32_t\s*\)\s*,\s*parameter\s*::", low):
            name, value = [s.strip() for s in lines[i].split("::", 1)[1].split("=", 1)]
            f["parameters"][name.upper()] = value
        i += 1
    return f


def fmt(d):
    if d is None:
        return "(no mapping in the table)"
    spec, attrs, dims = d
    return ", ".join([spec] + sorted(attrs)) + (" :: x(%s)" % dims if dims else "")


def check(h, f):
    problems = []
    cfuncs = [fn[0] for fn in h["functions"]]
    fnames = [it[1] for it in f["interfaces"]]
    for name in sorted(set(cfuncs) - set(fnames)):
        problems.append("%s: no bind(C) interface" % name)
    for name in sorted(set(fnames) - set(cfuncs)):
        problems.append("%s: bound in Fortran but not a function of dion.h" % name)
    for name in sorted(set(n for n in fnames if fnames.count(n) > 1)):
        problems.append("%s: %d interfaces (expected exactly one)" % (name, fnames.count(name)))
    common = [n for n in fnames if n in cfuncs]
    if common != [n for n in cfuncs if n in fnames]:
        problems.append("interfaces are not in header order")
    for line in f["other_binds"]:
        problems.append("bind(C) outside the interface table: %s" % line)

    by_bind = {it[1]: it for it in f["interfaces"]}
    for cname, cret, cparams in h["functions"]:
        if cname not in by_bind:
            continue
        fname, _, dummies, decls = by_bind[cname]
        if fname != cname:
            problems.append("%s: Fortran name %s differs from the C name" % (cname, fname))
        want_names = [p[1] for p in cparams]
        if dummies != [n.lower() for n in want_names]:
            problems.append("%s: dummies (%s) differ from the C parameters (%s)"
                            % (cname, ", ".join(dummies), ", ".join(want_names)))
        for k, (ctype, pname) in enumerate(cparams):
            nxt = cparams[k + 1][0] if k + 1 < len(cparams) else None
            want = expected_dummy(h, ctype, nxt)
            got = decls.get(pname.lower())
            if want is None:
                problems.append("%s: C type %r of %s has no entry in the table" % (cname, ctype, pname))
            elif got != want:
                problems.append("%s: %s (%s) is declared %s, the table says %s"
                                % (cname, pname, ctype, fmt(got) if got else "(missing)", fmt(want)))
        want = expected_result(h, cret)
        got = decls.get(fname.lower())
        if want is None:
            problems.append("%s: C return type %r has no entry in the table" % (cname, cret))
        elif got != want:
            problems.append("%s: result (%s) is declared %s, the table says %s"
                            % (cname, cret, fmt(got) if got else "(missing)", fmt(want)))
        extra = set(decls) - set(n.lower() for n in want_names) - {fname.lower()}
        for e in sorted(extra):
            problems.append("%s: declares %s, which is not a C parameter" % (cname, e))

    for sname, fields in h["structs"].items():
        comps = f["types"].get(sname)
        if comps is None:
            problems.append("struct %s: no type, bind(C) :: %s" % (sname, sname))
            continue
        fnames, cfields = [c[0] for c in comps], [fl[1].lower() for fl in fields]
        if fnames != cfields:
            k = next((i for i, (a, b) in enumerate(zip(fnames, cfields)) if a != b), min(len(fnames), len(cfields)))
            problems.append("struct %s: component %d is %s, C's field is %s (%d components, %d C fields)"
                            % (sname, k + 1, fnames[k] if k < len(fnames) else "(none)",
                               cfields[k] if k < len(cfields) else "(none)", len(fnames), len(cfields)))
            continue
        for (ctype, cname, dim), (_, got) in zip(fields, comps):
            want = expected_field(h, ctype, dim)
            if got != want:
                problems.append("struct %s: %s (%s%s) is declared %s, the table says %s"
                                % (sname, cname, ctype, "[%s]" % dim if dim else "", fmt(got), fmt(want)))
    for tname in sorted(set(f["types"]) - set(h["structs"])):
        problems.append("type %s is bind(C) but not a struct of dion.h" % tname)

    for cname, value in h["constants"].items():
        got = f["parameters"].get(cname)
        if got is None:
            problems.append("constant %s = %d: no parameter" % (cname, value))
        elif re.match(r"^-?\d+$", got) and int(got) != value:
            problems.append("constant %s: Fortran %s, C %d" % (cname, got, value))
    return problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--header", default=os.path.join(ROOT, "include", "dion.h"))
    ap.add_argument("--module", default=os.path.join(HERE, "dion.f90"))
    a = ap.parse_args()
    h = parse_header(a.header)
    f = parse_module(a.module)
    problems = check(h, f)
    if problems:
        print("check_interfaces: %d problem(s) in %s:" % (len(problems), a.module))
        for p in problems:
            print("  - " + p)
        return 1
    print("check_interfaces: %d functions, %d structs, %d constants of %s match %s"
          % (len(h["functions"]), len(h["structs"]), len(h["constants"]), os.path.basename(a.header),
             os.path.basename(a.module)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
