"""Tier 1: import boundaries. The scheduler, KV bookkeeping, decode grouping, planner, codec
and HTTP app load without torch (each in a fresh interpreter); the engine package never
imports the layers above it (nor speculative/ or the builder); the speculative package never
reaches into the scheduler."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvserve"

TORCH_FREE = [
    "kvserve.engine.scheduler",
    "kvserve.engine.kv.block_pool",
    "kvserve.engine.kv.prefix_cache",
    "kvserve.engine.kv.sizing",
    "kvserve.engine.decode_groups",
    "kvserve.planner",
    "kvserve.planner.simulate",
    "kvserve.ipc.codec",
    "kvserve.server.app",
    "kvserve.server.response_format",
    "kvserve.engine.constraint",
    "kvserve.router",
]

# Run in a fresh interpreter: import one module; if torch gets imported on the way, record
# the kvserve frames of the stack at that moment (the import chain that pulled it in).
_CHECK = r"""
import importlib, json, sys, traceback

class TorchSpy:
    chain = None

    def find_spec(self, name, path=None, target=None):
        if name == "torch" and TorchSpy.chain is None:
            TorchSpy.chain = [f"{f.filename}:{f.lineno}: {f.line}" for f in traceback.extract_stack()
                              if "/kvserve/" in f.filename.replace("\\", "/")]
        return None

sys.meta_path.insert(0, TorchSpy())
importlib.import_module(sys.argv[1])
print(json.dumps({"torch": "torch" in sys.modules, "chain": TorchSpy.chain,
                  "file": sys.modules[sys.argv[1]].__file__}))
"""


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_imports_without_torch(module):
    out = subprocess.run([sys.executable, "-c", _CHECK, module], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(result["file"]).resolve().is_relative_to(PACKAGE), result["file"]   # this checkout's code
    chain = "\n".join(result["chain"] or ["(torch imported, but not from a kvserve frame)"])
    assert not result["torch"], f"importing {module} imported torch, via:\n{chain}"


def _imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """Every module name a file imports, anywhere in it (function-local imports included):
    ``import a.b`` -> a.b; ``from a import b`` -> a and a.b (b may be a submodule); relative
    imports resolved against the file's package; ``importlib.import_module("a.b")`` -> a.b."""
    package = ".".join(path.relative_to(root).parts[:-1])        # a module's or __init__'s package
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__")))):
            names.add(node.args[0].value)
    return names


def _package_imports(subpackage: str) -> dict[str, set[str]]:
    files = sorted((PACKAGE / subpackage).rglob("*.py"))
    assert files, f"no files under kvserve/{subpackage}"
    return {str(f.relative_to(ROOT)): _imported_modules(f) for f in files}


def _offending(imports: dict[str, set[str]], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(f"{file}: {name}" for file, names in imports.items() for name in names
                  if any(name == p or name.startswith(p + ".") for p in prefixes))


def test_import_collector_sees_local_relative_and_dynamic_imports(tmp_path):
    pkg = tmp_path / "kvserve" / "engine"
    pkg.mkdir(parents=True)
    source = ("import os\nfrom . import step\nfrom ..server import app\n"
              "def f():\n    from kvserve.frontend.llm import LLM\n    import importlib\n"
              "    importlib.import_module('kvserve.loadgen.runner')\n")
    (pkg / "mod.py").write_text(source)
    names = _imported_modules(pkg / "mod.py", root=tmp_path)
    assert {"os", "kvserve.engine", "kvserve.engine.step", "kvserve.server", "kvserve.server.app",
            "kvserve.frontend.llm", "kvserve.frontend.llm.LLM", "kvserve.loadgen.runner"} <= names


def test_engine_does_not_import_the_layers_above_it():
    imports = _package_imports("engine")
    # not vacuous: the collector sees the engine's own imports, local ones included
    assert "kvserve.engine.scheduler" in imports["kvserve/engine/engine_core.py"]
    assert "kvserve.models.registry" in imports["kvserve/engine/model_loading.py"]   # a function-local import
    bad = _offending(imports, ("kvserve.frontend", "kvserve.server", "kvserve.planner", "kvserve.ipc",
                               "kvserve.loadgen", "kvserve.speculative", "kvserve.lora", "kvserve.builder",
                               "kvserve.structured", "kvserve.parallel"))
    assert not bad, ("kvserve/engine imports from frontend/server/planner/ipc/loadgen/speculative/lora/builder/"
                     "structured/parallel:\n"
                     + "\n".join(bad))


def test_speculative_does_not_import_the_scheduler():
    imports = _package_imports("speculative")
    assert "kvserve.engine.step" in imports["kvserve/speculative/verify.py"]     # not vacuous
    bad = _offending(imports, ("kvserve.engine.scheduler",))
    assert not bad, "kvserve/speculative imports the scheduler:\n" + "\n".join(bad)


def test_lora_does_not_import_the_scheduler():
    imports = _package_imports("lora")
    assert "kvserve.engine.step" in imports["kvserve/lora/batch.py"]     # not vacuous
    bad = _offending(imports, ("kvserve.engine.scheduler", "kvserve.engine.model_runner", "kvserve.server"))
    assert not bad, "kvserve/lora imports the scheduler, the runner or the server:\n" + "\n".join(bad)
