"""The seam every adapter changes an engine through: swaps of a module's function, a
class's staticmethod and one object's method, restored exactly; a shared seam installed
by its first owner and restored after its last."""

import types

import pytest

from commpress.engines.seam import Seam, Swap, install, restore


class Engine:
    @staticmethod
    def helper():
        return "stock helper"

    def step(self):
        return "stock step"


def test_swaps_restore_a_module_function_a_staticmethod_and_an_objects_method():
    module = types.ModuleType("engine_module")
    module.gather = lambda: "stock gather"
    engine = Engine()
    swaps = install([Swap(module, "gather", lambda: "ours"),
                     Swap(Engine, "helper", staticmethod(lambda: "ours")),
                     Swap(engine, "step", lambda: "ours"),
                     Swap(engine, "commpress", "handle")])
    assert (module.gather(), Engine.helper(), engine.step(), engine.commpress) == ("ours",) * 3 + (
        "handle",)
    assert swaps[2].original() == "stock step"  # the bound method, for the replacement
    restore(swaps)
    assert (module.gather(), Engine.helper(), engine.step()) == (
        "stock gather", "stock helper", "stock step")
    assert isinstance(vars(Engine)["helper"], staticmethod)
    assert "step" not in vars(engine) and not hasattr(engine, "commpress")


def test_an_install_that_fails_midway_restores_the_swaps_before_it():
    module = types.ModuleType("engine_module")
    module.gather = "stock"

    class ReadOnly:
        x = property(lambda self: 0)

    with pytest.raises(AttributeError):
        install([Swap(module, "gather", "ours"), Swap(ReadOnly(), "x", 1)])
    assert module.gather == "stock"


def test_a_swap_someone_else_replaced_again_is_left_to_them(caplog):
    module = types.ModuleType("engine_module")
    module.gather = "stock"
    swap = Swap(module, "gather", "ours").install()
    module.gather = "theirs"
    restore([swap])
    assert module.gather == "theirs" and "replaced by someone else" in caplog.text


def test_a_seam_is_installed_by_its_first_owner_and_restored_after_its_last():
    module = types.ModuleType("engine_module")
    module.gather = "stock"
    seam = Seam("test", [Swap(module, "gather", "ours")])
    first, second = object(), object()
    seam.acquire(first)
    seam.acquire(second)
    assert module.gather == "ours" and seam.owners == [first, second]
    seam.release(first)
    seam.release(first)  # a second release changes nothing
    assert module.gather == "ours" and seam.owners == [second]
    module.gather = "theirs"
    assert seam.broken() == ["engine_module.gather"]
    module.gather = "ours"
    seam.release(second)
    assert module.gather == "stock" and seam.broken() == []
    seam.acquire(first)  # installed again from scratch
    assert module.gather == "ours"
    seam.release(first)
