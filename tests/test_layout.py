"""The package layout's import rules (docs/architecture.md, "Packages").

Every ``import`` in meshinfer/ (module level or inside a function) is read with ``ast`` and
checked against the allowed direction: ``core`` <- ``wire``, ``engine``, ``text`` <- ``peer``,
``client`` <- ``app``. A subprocess then checks that the torch-free modules load without torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import meshinfer

PKG = Path(meshinfer.__file__).parent

#: Package -> the meshinfer packages its modules may import (besides their own).
ALLOWED = {
    "core": set(),
    "wire": {"core"},
    "engine": {"core"},
    "text": {"core"},
    # the peer serves its model's tokenizer bundle (a client takes it from the first hop)
    "peer": {"core", "wire", "engine", "text"},
    "client": {"core", "wire", "text"},
    "app": {"core", "wire", "engine", "text", "peer", "client"},
}
#: Module -> extra packages it may import, with the reason.
EXCEPTIONS = {
    "client.draft": {"engine"},  # the draft model runs at the client: the one engine import there
}
#: Modules that must load without torch (the planner, the wire catalogue, the text layer).
TORCH_FREE = ["meshinfer.core.config", "meshinfer.core.errors", "meshinfer.core.gguf_header",
              "meshinfer.core.generation", "meshinfer.core.sampling_params",
              "meshinfer.wire.protocol", "meshinfer.wire.discovery", "meshinfer.client.routing",
              "meshinfer.client.coverage", "meshinfer.client.speculative", "meshinfer.text.tokenizer",
              "meshinfer.text.toolcalls", "meshinfer.text.vocab", "meshinfer.text.template",
              "meshinfer.text.bundle", "meshinfer.text.stream", "meshinfer.text.prompt_bound", "meshinfer.peer.batching"]


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported meshinfer module without the ``meshinfer.`` prefix) for every import."""
    name = _module_name(path)
    package = name.split(".")[:-1] if path.name != "__init__.py" else name.split(".")
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("meshinfer"):
                target = node.module[len("meshinfer."):] if node.module != "meshinfer" else ""
            else:
                continue
            if not target:  # from meshinfer import a, b
                out += [(node.lineno, a.name) for a in node.names]
            else:
                out += [(node.lineno, target)]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name[len("meshinfer."):]) for a in node.names
                    if a.name.startswith("meshinfer.")]
    return out


def test_every_module_lives_in_a_package():
    flat = sorted(p.name for p in PKG.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert flat == []


def test_imports_point_one_way():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        if path.parent == PKG:
            continue
        mod = _module_name(path)
        own = mod.split(".")[0]
        allowed = ALLOWED[own] | EXCEPTIONS.get(mod, set()) | {own}
        for line, target in _imports(path):
            if target.split(".")[0] not in allowed:
                bad.append(f"{path.relative_to(PKG.parent)}:{line} ({own}) imports meshinfer.{target}")
    assert bad == []


def test_the_walk_sees_an_import_inside_a_function():
    # A peer module importing the client inside a function must be seen (and is refused).
    fake = PKG / "peer" / "_layout_probe.py"
    src = "def f():\n    from meshinfer.client.session import MeshClient\n"
    try:
        fake.write_text(src)
        assert _imports(fake) == [(2, "client.session")]
        assert "client" not in ALLOWED["peer"]
    finally:
        fake.unlink()


def test_planner_wire_and_text_load_without_torch():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in TORCH_FREE)
            + "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


#: Size limits from STYLE.md: a class one can hold in one's head, a function one can read at once.
MAX_CLASS_LINES, MAX_FUNCTION_LINES = 300, 60


def test_no_class_or_function_is_over_the_size_limits():
    over = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            limit = (MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None)
            if limit and node.end_lineno - node.lineno + 1 > limit:
                over.append(f"{path.relative_to(PKG.parent)}:{node.lineno} {node.name} "
                            f"({node.end_lineno - node.lineno + 1} lines, limit {limit})")
    assert over == []
