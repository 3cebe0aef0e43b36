"""The schedule registry: generators register here under their CLI name.

This module imports no generator, so every generator module can import
:func:`register` from it without a cycle; :mod:`zeropipe.core.schedules` imports the
generator modules (which registers them) and re-exports these names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from zeropipe.core.errors import ScheduleError
from zeropipe.core.gc_pause import paused_gc
from zeropipe.core.ir import Schedule

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
    with paused_gc():
        return gen.build(ranks, microbatches, chunks)
