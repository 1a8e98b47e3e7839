"""The planner's one cache: what a search computes once and every candidate that shares its inputs
reads (the parameters' spec tables and terms, their divisibility, the completed rules, a pipeline
table's loops)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")


@dataclasses.dataclass
class Cache:
    """``get(make, key, *args)``: ``make(*args)``, computed once per (``make``, ``key``); ``key`` names
    everything the result depends on (a search keeps one Cache across its candidates; a single
    estimate uses a fresh one)."""

    entries: dict[tuple[Callable, Hashable], Any] = dataclasses.field(default_factory=dict)

    def get(self, make: Callable[..., T], key: Hashable, *args) -> T:
        if (make, key) not in self.entries:
            self.entries[(make, key)] = make(*args)
        return self.entries[(make, key)]
