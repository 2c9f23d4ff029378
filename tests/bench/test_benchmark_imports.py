"""Every name a benchmark script imports from commpress exists: most scripts run only on
the emulated cluster or a GPU, so a renamed function would otherwise surface there first."""

import ast
import glob
import importlib
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "*.py")))


def _commpress_imports(path: str) -> list[tuple[str, str | None]]:
    """(module, name) of every ``from commpress… import name`` and ``import commpress…``
    in the file, at any depth (scripts import inside functions)."""
    out = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("commpress"):
            out += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            out += [(alias.name, None) for alias in node.names
                    if alias.name.startswith("commpress")]
    return out


@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_every_commpress_name_a_script_imports_exists(script):
    missing = []
    for module, name in _commpress_imports(script):
        loaded = importlib.import_module(module)
        if name is not None and not hasattr(loaded, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{module}.{name}")
    assert missing == []
