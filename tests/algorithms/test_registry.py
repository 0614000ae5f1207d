import pytest

from torchrlhf.algorithms import Registry


def test_registry_lookup_duplicate_and_unknown():
    reg = Registry("widget")

    @reg.register("a", "alias_a")
    def a():
        return 1

    assert reg["a"] is a and reg["alias_a"] is a
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(lambda: 2)
    with pytest.raises(ValueError, match=r"unknown widget 'b'; valid names: a, alias_a"):
        reg["b"]
