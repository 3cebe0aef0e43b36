"""Schedule generators: pure functions of (ranks, microbatches, chunks); no torch import.

Each generator is registered under its CLI name and returns a compute-only
:class:`~zeropipe.ir.Schedule` (lower it with :func:`zeropipe.lower.lower`).
``generate("1f1b", ranks=4, microbatches=8)`` is the one entry point; a
combination a generator cannot produce raises ``ScheduleError(rule="unsupported")``
saying which values would work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from zeropipe.errors import ScheduleError
from zeropipe.ir import Schedule

__all__ = ["GENERATORS", "Generator", "generate", "register"]


@dataclass(frozen=True)
class Generator:
    """A registered generator: ``build(ranks, microbatches, chunks) -> Schedule``."""

    name: str
    description: str
    build: Callable[[int, int, int], Schedule]
    default_chunks: int = 1
    takes_chunks: bool = False  # whether chunks may differ from default_chunks


GENERATORS: dict[str, Generator] = {}


def register(
    name: str, description: str, *, default_chunks: int = 1, takes_chunks: bool = False
) -> Callable[[Callable[[int, int, int], Schedule]], Callable[[int, int, int], Schedule]]:
    """Class-free registration: ``@register("gpipe", "all forwards, then all backwards")``."""

    def wrap(build: Callable[[int, int, int], Schedule]) -> Callable[[int, int, int], Schedule]:
        GENERATORS[name] = Generator(name, description, build, default_chunks, takes_chunks)
        return build

    return wrap


def generate(name: str, ranks: int, microbatches: int, chunks: int | None = None) -> Schedule:
    """Build the named schedule for ``ranks`` pipeline ranks and ``microbatches``.

    ``chunks`` is the number of stages per rank (model chunks); the model is cut
    into ``ranks * chunks`` stages.
    """
    gen = GENERATORS.get(name)
    if gen is None:
        raise ScheduleError(
            f"unknown schedule {name!r}; choose one of {', '.join(sorted(GENERATORS))} "
            f"(`zeropipe schedules` lists them)",
            rule="unsupported",
        )
    if chunks is None:
        chunks = gen.default_chunks
    if ranks < 1 or microbatches < 1 or chunks < 1:
        raise ScheduleError(
            f"ranks, microbatches and chunks must be >= 1, got {ranks}, {microbatches}, {chunks}",
            rule="unsupported",
        )
    if not gen.takes_chunks and chunks != gen.default_chunks:
        raise ScheduleError(
            f"{name} uses {gen.default_chunks} chunk(s) per rank; drop --chunks {chunks} "
            f"or pick interleaved-1f1b / looped-bfs",
            rule="unsupported",
        )
    return gen.build(ranks, microbatches, chunks)


# Importing the generator modules registers them.
from zeropipe.schedules import (  # noqa: E402,F401
    auto,
    basic,
    dualpipev,
    interleaved,
    looped_bfs,
    zbv,
    zero_bubble,
)
