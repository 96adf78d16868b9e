"""Parameter grids in two tiers: a pairwise cover of the product runs by default, every other case of the
full product with `-m slow`.

A pairwise cover holds each value of each parameter beside each value of every other parameter (a dtype
with each head size, a window with each batch), which is where a kernel's cases differ; the full product
multiplies the cases without adding a pair. The slow tier still runs every case.
"""

from __future__ import annotations

import itertools

import pytest

ParameterSet = type(pytest.param(None))  # what pytest.param returns


def _entry(value) -> ParameterSet:
    """One axis entry as a ParameterSet: its values (one, or several for a multi-name axis) and its id."""
    if isinstance(value, ParameterSet):
        return value
    if value is None or isinstance(value, bool | int | float | str):
        return pytest.param(value, id=str(value))
    raise TypeError(f"{value!r}: give it an id with pytest.param(value, id=...)")


def pairwise_grid(*axes: list) -> list[ParameterSet]:
    """The product of `axes` (each a list of plain values or of `pytest.param(..., id=...)`), in product
    order, as `pytest.param`s whose ids are those stacked `parametrize`s would give: a greedy pairwise
    cover unmarked, the other cases marked slow. Pass the axes in the order the ids read."""
    entries = [[_entry(v) for v in axis] for axis in axes]
    cases = list(itertools.product(*[range(len(axis)) for axis in entries]))

    def pairs(case: tuple[int, ...]) -> set:
        return {((a, case[a]), (b, case[b])) for a, b in itertools.combinations(range(len(case)), 2)}

    uncovered = set().union(*map(pairs, cases)) if len(axes) > 1 else set()
    fast = set(cases) if len(axes) < 2 else set()
    while uncovered:
        best = max(cases, key=lambda case: len(pairs(case) & uncovered))  # the first among equals
        fast.add(best)
        uncovered -= pairs(best)
    out = []
    for case in cases:
        chosen = [entries[axis][i] for axis, i in enumerate(case)]
        values = tuple(v for entry in chosen for v in entry.values)
        marks = [m for entry in chosen for m in entry.marks] + ([] if case in fast else [pytest.mark.slow])
        out.append(pytest.param(*values, id="-".join(entry.id for entry in chosen), marks=marks))
    return out


def first_fast(values: list) -> list:
    """One parameter's values, the first unmarked and the others marked slow: the first shows the feature
    works, the others that it holds under each configuration (or input) they name."""
    return [values[0], *(pytest.param(v, marks=pytest.mark.slow) for v in values[1:])]
