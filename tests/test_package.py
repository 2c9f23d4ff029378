"""The package's layout: every module reachable by its dotted name."""

import importlib
import pkgutil

import commpress


def test_no_module_is_shadowed_by_a_name_its_package_exports():
    # a package attribute named like a submodule (a function ``all_reduce`` over module
    # ``all_reduce``) breaks ``import a.b as m`` and ``mock.patch("a.b.name")``
    shadowed = []

    def walk(package):
        for info in pkgutil.iter_modules(package.__path__):
            if info.name == "__main__":
                continue
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            if getattr(package, info.name) is not module:
                shadowed.append(module.__name__)
            if info.ispkg:
                walk(module)

    walk(commpress)
    assert shadowed == []
