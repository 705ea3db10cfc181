"""The checked-in stubs (hetpipe_core/_C.pyi, _mpi.pyi) against the compiled modules: the same public
functions and classes, each class with the same public methods and properties, and each function and
method with the same argument names (and which of them have defaults) as pybind11's signature in its
``__doc__``. A drift fails naming the module, the name and what differs.

The compiled side is read in a subprocess, so that importing mpi4py for ``_mpi`` starts no MPI here.
"""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import hetpipe_core

PKG = Path(hetpipe_core.__file__).resolve().parent

# Prints, as JSON, the public names of hetpipe_core.<argv[1]>: each function with its docstring, each
# class with its members (public ones, and the dunders the module binds itself) and everything dir() lists.
COLLECT = r"""
import importlib, inspect, json, sys
if sys.argv[1] == "_mpi":
    import mpi4py.MPI  # loads the libmpi hetpipe_core._mpi links
module = importlib.import_module("hetpipe_core." + sys.argv[1])

def member(value):
    if isinstance(value, property):
        return "property", ""
    if isinstance(value, staticmethod):
        return "staticmethod", value.__func__.__doc__ or ""
    if type(value).__name__ == "instancemethod":      # a pybind11 method
        return "method", value.__doc__ or ""
    return "attribute", ""

out = {}
for name in dir(module):
    if name.startswith("_"):
        continue
    value = getattr(module, name)
    if inspect.isclass(value):
        members = {}
        for m, v in vars(value).items():
            kind, doc = member(v)
            dunder = m.startswith("__") and m.endswith("__")
            if (dunder and kind == "method") or not m.startswith("_"):
                members[m] = [kind, doc]
        out[name] = {"kind": "class", "members": members, "dir": dir(value)}
    elif callable(value):
        out[name] = {"kind": "function", "doc": value.__doc__ or ""}
    else:
        out[name] = {"kind": "attribute"}
print(json.dumps(out))
"""

# Dunders a stub may declare that Python itself provides without a class attribute: PEP 688's
# __buffer__ exists as an attribute from Python 3.12 on (before, the buffer protocol has no name).
IMPLICIT_BEFORE = {"__buffer__": (3, 12)}


def compiled(module: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", COLLECT, module], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


# --- pybind11 signatures --------------------------------------------------------------------------

def _split_params(text: str) -> list:
    """The comma-separated parameters of ``(...)`` at the start of ``text`` (brackets and quotes kept whole)."""
    assert text.startswith("("), text
    parts, depth, quote, current = [], 0, None, ""
    for ch in text:
        if quote:
            current += ch
            if ch == quote:
                quote = None
            continue
        if ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
            if depth == 1:
                continue
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                break
        elif ch == "," and depth == 1:
            parts.append(current)
            current = ""
            continue
        current += ch
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def _token(param: str) -> str:
    """``name`` or ``name=`` (it has a default); ``*``, ``/``, ``*args`` and ``**kwargs`` as they are."""
    if param in ("*", "/") or param.startswith("*"):
        return param.split(":")[0].strip()
    name = param.split(":")[0].split("=")[0].strip()
    return name + ("=" if "=" in param else "")


def compiled_signatures(name: str, doc: str):
    """The parameter lists pybind11's ``doc`` gives for ``name`` (one per overload), or None if it gives none."""
    lines = doc.splitlines()
    if len(lines) > 1 and lines[1].strip() == "Overloaded function.":
        heads = [ln.split(". ", 1)[1] for ln in lines if re.match(rf"^\d+\. {re.escape(name)}\(", ln)]
    else:
        heads = lines[:1] if lines and lines[0].startswith(name + "(") else []
    if not heads:
        return None
    return {tuple(_token(p) for p in _split_params(h[len(name):])) for h in heads}


# --- the stub -------------------------------------------------------------------------------------

def stub_params(fn: ast.FunctionDef) -> tuple:
    a = fn.args
    positional = a.posonlyargs + a.args
    first_default = len(positional) - len(a.defaults)
    out = []
    for i, arg in enumerate(positional):
        out.append(arg.arg + ("=" if i >= first_default else ""))
        if a.posonlyargs and i == len(a.posonlyargs) - 1:
            out.append("/")
    if a.vararg:
        out.append("*" + a.vararg.arg)
    elif a.kwonlyargs:
        out.append("*")
    out += [arg.arg + ("=" if d is not None else "") for arg, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append("**" + a.kwarg.arg)
    return tuple(out)


def _decorators(fn: ast.FunctionDef) -> set:
    return {ast.unparse(d) for d in fn.decorator_list}


def _is_protocol(cls: ast.ClassDef) -> bool:
    """A typing aid of the stub (e.g. DLPackArray), not a class of the module."""
    return any(ast.unparse(b).split(".")[-1] == "Protocol" for b in cls.bases)


def stub_members(body) -> dict:
    """``{name: (kind, {parameter lists})}`` of a module's or a class's body in a stub."""
    out = {}
    for node in body:
        if isinstance(node, ast.FunctionDef):
            decorators = _decorators(node)
            if any(d.endswith((".setter", ".deleter")) for d in decorators):
                continue
            kind = ("property" if "property" in decorators else
                    "staticmethod" if "staticmethod" in decorators else "method")
            _, params = out.get(node.name, (kind, set()))
            out[node.name] = (kind, params | {stub_params(node)})
        elif isinstance(node, ast.ClassDef) and not _is_protocol(node):
            out[node.name] = ("class", node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = ("attribute", set())
    return out


# --- the comparison -------------------------------------------------------------------------------

def _compare_params(where: str, stub_params_: set, doc: str, name: str, problems: list) -> None:
    got = compiled_signatures(name, doc)
    if got is not None and got != stub_params_:
        problems.append(f"{where}: the stub's arguments {sorted(stub_params_)} are not the module's {sorted(got)}")


def _compare_class(module: str, name: str, node: ast.ClassDef, real: dict, problems: list) -> None:
    stub = stub_members(node.body)
    members = real["members"]
    implicit = {d for d, v in IMPLICIT_BEFORE.items() if sys.version_info < v}
    for m in sorted(set(members) - set(stub)):
        problems.append(f"{module}.{name}.{m}: in the module ({members[m][0]}), missing from the stub")
    for m in sorted(set(stub) - set(members)):
        dunder_elsewhere = m.startswith("__") and (m in real["dir"] or m in implicit)
        if not dunder_elsewhere:
            problems.append(f"{module}.{name}.{m}: in the stub, not in the module")
    for m in sorted(set(stub) & set(members)):
        (kind, params), (real_kind, doc) = stub[m], members[m]
        if kind != real_kind:
            problems.append(f"{module}.{name}.{m}: a {kind} in the stub, a {real_kind} in the module")
        elif kind in ("method", "staticmethod"):
            _compare_params(f"{module}.{name}.{m}", params, doc, m, problems)


def stub_drift(module: str) -> list:
    """What differs between ``hetpipe_core/<module>.pyi`` and the compiled ``hetpipe_core.<module>``."""
    stub = {n: v for n, v in stub_members(ast.parse((PKG / f"{module}.pyi").read_text()).body).items()
            if not n.startswith("_")}
    real = compiled(module)
    problems = []
    for n in sorted(set(real) - set(stub)):
        problems.append(f"{module}.{n}: in the module ({real[n]['kind']}), missing from the stub")
    for n in sorted(set(stub) - set(real)):
        problems.append(f"{module}.{n}: in the stub, not in the module")
    for n in sorted(set(stub) & set(real)):
        (kind, value), found = stub[n], real[n]
        if {"method": "function"}.get(kind, kind) != found["kind"]:
            problems.append(f"{module}.{n}: a {kind} in the stub, a {found['kind']} in the module")
        elif kind == "class":
            _compare_class(module, n, value, found, problems)
        elif kind == "method":
            _compare_params(f"{module}.{n}", value, found["doc"], n, problems)
    return problems


def test_signature_parsing_by_hand():
    doc = "f(self: m.T, a: typing.SupportsInt = 0, *, b: object = 'x,y', c: list[tuple[int, int]] = [], " \
          "**kwargs) -> None\n\nDoc."
    assert compiled_signatures("f", doc) == {("self", "a=", "*", "b=", "c=", "**kwargs")}
    over = "g(*args, **kwargs)\nOverloaded function.\n\n1. g(x: int) -> None\n\n2. g(x: int, y: str) -> None\n"
    assert compiled_signatures("g", over) == {("x",), ("x", "y")}
    assert compiled_signatures("h", "no signature here") is None
    fn = ast.parse("def f(a, b=1, /, c=2, *args, d, e=3, **kw): ...").body[0]
    assert stub_params(fn) == ("a", "b=", "/", "c=", "*args", "d", "e=", "**kw")


def test_c_stub_matches_the_module():
    problems = stub_drift("_C")
    assert not problems, "hetpipe_core/_C.pyi drifted from the module:\n" + "\n".join(problems)


@pytest.mark.skipif(not hetpipe_core.build_info()["mpi_built"], reason="hetpipe_core._mpi is not built (no MPI)")
def test_mpi_stub_matches_the_module():
    problems = stub_drift("_mpi")
    assert not problems, "hetpipe_core/_mpi.pyi drifted from the module:\n" + "\n".join(problems)
