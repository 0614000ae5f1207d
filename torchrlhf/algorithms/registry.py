"""Name -> function registries, so config strings select algorithms."""

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


class Registry(dict):
    """A dict of named functions; an unknown name raises ValueError listing the valid ones."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def register(self, *names: str) -> Callable[[F], F]:
        def deco(fn: F) -> F:
            for name in names:
                if name in self:
                    raise ValueError(f"{self.kind} {name!r} is already registered")
                self[name] = fn
            return fn

        return deco

    def __missing__(self, name: str):
        raise ValueError(f"unknown {self.kind} {name!r}; valid names: {', '.join(sorted(self))}")
