"""No pickle, eval or exec on any path that handles network data (checked on the source)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import meshinfer

PACKAGE = Path(meshinfer.__file__).parent
#: Every module of the packages that handle network data (docs/architecture.md, "Packages").
NETWORK_MODULES = sorted(p.relative_to(PACKAGE).as_posix() for package in ("wire", "peer", "client", "text", "app")
                         for p in (PACKAGE / package).glob("*.py"))
FORBIDDEN_IMPORTS = {"pickle", "cPickle", "dill", "marshal", "shelve", "joblib", "cloudpickle"}
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}


def calls_and_imports(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (("import", a.name.split(".")[0], node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield "import", node.module.split(".")[0], node.lineno
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
            owner = fn.value.id if isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) else ""
            yield "call", f"{owner}.{name}" if owner else name, node.lineno
            if name == "unpackb":
                kws = {k.arg: k.value for k in node.keywords}
                yield "unpackb", ast.unparse(kws.get("max_ext_len", ast.Constant(None))), node.lineno


@pytest.mark.parametrize("module", NETWORK_MODULES)
def test_no_unsafe_deserialization(module):
    found = list(calls_and_imports(PACKAGE / module))
    bad = [(kind, name, line) for kind, name, line in found
           if (kind == "import" and name in FORBIDDEN_IMPORTS)
           or (kind == "call" and (name in FORBIDDEN_CALLS or name in ("torch.load", "np.load", "numpy.load")))]
    assert not bad, f"{module}: {bad}"


def test_msgpack_decoding_refuses_extension_types():
    found = list(calls_and_imports(PACKAGE / "wire" / "protocol.py"))
    unpacks = [value for kind, value, _ in found if kind == "unpackb"]
    assert unpacks and all(value == "0" for value in unpacks)


def test_chat_templates_render_in_a_sandbox():
    """A GGUF's chat template comes from whoever made the file: it must not reach Python internals."""
    import jinja2.exceptions

    from meshinfer.text.template import compile_template as _compile_template

    hostile = _compile_template("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        hostile.render(messages=[])
