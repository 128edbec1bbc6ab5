# SPDX-License-Identifier: MIT
"""The parse of include/dion.h shared by the bindings' static checks
(bindings/fortran/check_interfaces.py, bindings/julia/check_bindings.py):
functions with their normalised C types, the int32_t enum typedefs, the
opaque handle typedefs, the option/descriptor structs and the integer
constants. Only the regular shape dion.h keeps is understood; anything else
makes parse_header stop with a message rather than guess."""
import re


def strip_c(text):
    """Removes comments and preprocessor lines (joining backslash continuations first)."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    text = re.sub(r"\\\n", " ", text)
    return "\n".join("" if line.lstrip().startswith("#") else line for line in text.split("\n"))


def norm_ctype(t):
    """'const  dion_options_t *' -> 'const dion_options_t*'."""
    return re.sub(r"\s*\*", "*", re.sub(r"\s+", " ", t).strip())


def split_decl(decl):
    """'const dion_options_t* options' -> ('const dion_options_t*', 'options', None); 'int64_t s[N]' -> dim N."""
    decl = re.sub(r"\s+", " ", decl).strip()
    m = re.match(r"^(.*?)([A-Za-z_]\w*)\s*(?:\[\s*(\w+)\s*\])?$", decl)
    if not m:
        raise ValueError("cannot parse declaration %r" % decl)
    return norm_ctype(m.group(1)), m.group(2), m.group(3)


def parse_header(path, tool="dion_header"):
    """{"functions": [(name, return ctype, [(ctype, name), ...])], "int_typedefs": {name},
    "handles": {typedef: struct tag}, "structs": {typedef: [(ctype, name, dim)]}, "constants": {name: int}}."""
    raw = open(path).read()
    text = strip_c(raw)
    h = {"functions": [], "int_typedefs": set(), "handles": {}, "structs": {}, "constants": {}}
    h["int_typedefs"] = set(re.findall(r"typedef\s+int32_t\s+(\w+)\s*;", text))
    for m in re.finditer(r"typedef\s+struct\s+(\w+)\s*\*\s*(\w+)\s*;", text):
        h["handles"][m.group(2)] = m.group(1)
    for m in re.finditer(r"typedef\s+struct\s+\w+\s*\{(.*?)\}\s*(\w+)\s*;", text, re.S):
        h["structs"][m.group(2)] = [split_decl(f) for f in m.group(1).split(";") if f.strip()]
    for m in re.finditer(r"\benum\s*\{(.*?)\}\s*;", text, re.S):
        for item in m.group(1).split(","):
            if item.strip():
                name, value = [s.strip() for s in item.split("=")]
                h["constants"][name] = int(value)
    for m in re.finditer(r"^\s*#\s*define\s+(DION_\w+)\s+\(?(-?\d+)\)?\s*$", raw, re.M):
        h["constants"][m.group(1)] = int(m.group(2))
    # DION_API <return type> <name>(<parameters>); possibly over several lines.
    protos = list(re.finditer(r"DION_API\s+([^;{}()]*?)\b(dion_\w+)\s*\(([^()]*)\)\s*;", text, re.S))
    if len(protos) != text.count("DION_API"):
        raise SystemExit("%s: parsed %d prototypes but the header has %d DION_API declarations"
                         % (tool, len(protos), text.count("DION_API")))
    for m in protos:
        args = m.group(3).strip()
        params = [] if args in ("", "void") else [split_decl(a)[:2] for a in args.split(",")]
        h["functions"].append((m.group(2), norm_ctype(m.group(1)), params))
    return h


def resolve(h, t):
    """Strips const and resolves the int32_t enum typedefs."""
    base = t.replace("const ", "").strip()
    return "int32_t" if base in h["int_typedefs"] else base
