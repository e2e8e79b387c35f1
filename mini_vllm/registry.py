"""Registries: where an extension point lists what plugs into it (standard library only).

An attention backend or a model family is added by decorating one function
(``@register_attention_backend("torch")`` in ``mini_vllm/attention/__init__.py``,
``@register_model_family("Qwen3ForCausalLM", model_type="qwen3")`` in
``mini_vllm/model_config.py``); whoever needs the valid names (``EngineConfig``'s
checks, ``get_attn_backend``, ``ModelConfig.from_dict``) reads them from the
registry, so there is no second list to keep in step. The style is
mini-sglang's (``Registry`` in ``minisgl/utils``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Entries by name, in the order they were registered."""

    def __init__(self, kind: str) -> None:
        self.kind = kind  # "attention backend": what the error messages call an entry
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """A decorator that registers what it decorates under ``name`` (ValueError if the name is taken)."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"a {self.kind} is registered under a non-empty str, got {name!r}")

        def decorator(entry: T) -> T:
            self.add(name, entry)
            return entry

        return decorator

    def add(self, name: str, entry: T) -> None:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = entry

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __getitem__(self, name: str) -> T:
        return self._entries[name]

    def get(self, name: str) -> T | None:
        return self._entries.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self._entries)})"
