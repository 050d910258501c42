"""The schedule rule: one structure of one kernel on one kind of target, in the manner of TVM's
dlight rules.

A rule gives both the default schedule and the MetaSchedule design space of its structure from
the same code, so the two cannot drift apart: every tile size is asked of a :class:`Choices`,
which answers the default's value when the rule is applied untuned, and a sampled choice over
the candidates (the default's value among them) when it is applied as a design space.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from typing import ClassVar

from tvm import s_tir, tirx
from tvm.target import Target


class Rule:
    """A schedule rule. Subclasses set :attr:`kernel` and :attr:`target_kind` and implement
    :meth:`apply`."""

    #: the kernel of :mod:`tvm_deform.ir.definition` the rule schedules: "forward",
    #: "backward" (every gradient but the input's) or "grad_input" (the input's)
    kernel: ClassVar[str]
    #: the target kind it schedules for: "llvm" or "cuda"
    target_kind: ClassVar[str]
    #: whether the rule is tried for the default schedule; a rule that is not (a structure
    #: that measured slower than the default's where it applies) still gives its design space
    default: ClassVar[bool] = True

    def apply(
        self, func: tirx.PrimFunc, target: Target, tunable: bool = False
    ) -> s_tir.Schedule | None:
        """``func`` under this rule's structure: the default schedule (``tunable=False``), or a
        design space whose tile sizes are sampled choices (``tunable=True``). None when the
        rule does not take ``func``: not its kernel, or (untuned) a layer the default gives to
        another structure. A design space is offered for more layers than the default takes,
        so that a tuned win stays reachable."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return type(self).__name__


class Choices:
    """Answers a rule's tile-size questions: the default's value, or, in a design space, a
    ``sample_categorical`` over the candidates that are valid (the default's value included
    when it is valid).

    Valid values keep every loop longer than one: a unit loop disappears from the IR and
    changes how many loops a later ``get_loops`` returns, which breaks MetaSchedule's replay
    of mutated traces."""

    def __init__(self, sch: s_tir.Schedule, tunable: bool):
        self.sch = sch
        self.tunable = tunable

    def __call__(
        self,
        candidates: Iterable[int],
        default: int,
        valid: Callable[[int], bool] = lambda value: True,
    ):
        """The default's value untuned; else one of the valid values (an int when there is
        one, a sampled ``ExprRV`` when there are several; the default when none is valid).
        A sampled choice starts at the default's value, or where it is not valid at the valid
        value nearest to it, so that a design space as returned is the rule's own schedule:
        the default schedule wherever the default's values are valid, and the same schedule
        every time it is generated."""
        answer = self._answer(candidates, default, valid)
        asked = _ASKED.get()
        if asked is not None:
            asked.setdefault(id(self.sch), (self.sch, []))[1].append(answer)
        return answer

    def _answer(self, candidates: Iterable[int], default: int, valid: Callable[[int], bool]):
        if not self.tunable:
            return default
        options = sorted({value for value in (*candidates, default) if valid(value)})
        if len(options) <= 1:
            return options[0] if options else default
        nearest = min(options, key=lambda value: (abs(value - default), value))
        return self.sch.sample_categorical(
            options, [1.0 / len(options)] * len(options), decision=options.index(nearest)
        )


#: the answers each schedule's :class:`Choices` gave while :func:`answers_given` records them
_ASKED: ContextVar[dict[int, tuple[s_tir.Schedule, list]] | None] = ContextVar(
    "asked", default=None
)


@contextlib.contextmanager
def answers_given() -> Iterator[Callable[[s_tir.Schedule], list]]:
    """Records the answers the :class:`Choices` of the schedules built in its body give, in the
    order the rule asked them: yields a function from a schedule to its answers (an int for a
    question with one valid value, the ``ExprRV`` of its ``sample_categorical`` otherwise)."""
    asked: dict[int, tuple[s_tir.Schedule, list]] = {}
    token = _ASKED.set(asked)
    try:
        yield lambda sch: list(asked.get(id(sch), (sch, []))[1])
    finally:
        _ASKED.reset(token)
