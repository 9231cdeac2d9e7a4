"""hydra.sweeper.params' grammar (hydra-optuna-sweeper's, which users write) as Optuna distributions.

| written                          | Optuna distribution                          | draws                          |
|----------------------------------|----------------------------------------------|--------------------------------|
| `choice(a, b, ...)`              | CategoricalDistribution                      | one of the values              |
| `interval(a, b)`, a b integers   | IntDistribution(a, b)                        | an int, a <= x <= b            |
| `interval(a, b)`, else           | FloatDistribution(a, b)                      | a float, a <= x <= b           |
| `tag(log, interval(a, b))`       | the same with log=True                       | uniform in log(x)              |
| `range(a, b[, s])`               | IntDistribution / FloatDistribution(step=s)  | a, a+s, ... < b (as Hydra's)   |
| `tag(log, range(a, b))`, ints    | IntDistribution(a, b - 1, log=True)          | an int < b, uniform in log(x)  |
| `shuffle(range(...))`            | CategoricalDistribution of range's values    | one of them                    |
| a plain value `k=v`              | none: every trial gets `k=v`                 |                                |

`range` means what it means under Hydra's basic sweeper (and Python's `range`): the stop is excluded,
so `range(1,4)` draws 1, 2 or 3 under either sweeper (hydra-optuna-sweeper's mapping drew 4 as well).
Hydra's `interval` turns its bounds into floats; two integers written there draw integers (the plugin
meant to, but tested the converted floats: `interval(32, 256)` drew widths like 97.3)."""

import math
import re
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep, Transformer
from hydra.errors import OverrideParseException
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

from trainkit.errors import ConfigError

Space = dict[str, BaseDistribution]
CHOICE_TYPES = (str, int, float, bool, type(None))  # what Optuna stores as a categorical value
_INTERVAL = re.compile(r"interval\(\s*([^,()]+?)\s*,\s*([^,()]+?)\s*\)")
_INT = re.compile(r"[+-]?\d+")


def parse(arguments: list[str]) -> tuple[Space, dict[str, str]]:
    """(the search space, the fixed overrides {key: value text}) of `key=value` overrides; a later one
    for a key replaces an earlier one (the command line's over hydra.sweeper.params)."""
    try:
        overrides = OverridesParser.create().parse_overrides(arguments)
    except OverrideParseException as error:
        raise ConfigError(f"hydra.sweeper.params: {' '.join(str(error).split())}") from None
    space: Space = {}
    fixed: dict[str, str] = {}
    for override in overrides:
        key = override.get_key_element()
        space.pop(key, None)
        fixed.pop(key, None)
        if override.is_sweep_override():
            space[key] = distribution(override)
        else:
            fixed[key] = override.get_value_element_as_str()
    return space, fixed


def distribution(override: Override) -> BaseDistribution:
    """One sweep override's distribution (the module's table)."""
    key, value = override.get_key_element(), override.value()
    log = "log" in getattr(value, "tags", set())
    said = override.input_line or key
    if isinstance(value, IntervalSweep):
        assert value.start is not None and value.end is not None
        if value.start >= value.end:
            raise ConfigError(f"hydra.sweeper.params: {said} is empty (interval(low, high) needs low < high)")
        if log and value.start <= 0:
            raise ConfigError(f"hydra.sweeper.params: {said}: a log interval needs a low bound > 0")
        if _integers(override):
            return IntDistribution(int(value.start), int(value.end), log=log)
        return FloatDistribution(value.start, value.end, log=log)
    values: list[Any] = list(override.sweep_iterator(transformer=Transformer.encode))
    if not values:
        raise ConfigError(f"hydra.sweeper.params: {said} has no values")
    if isinstance(value, RangeSweep) and not value.shuffle:
        step = abs(value.step or 1)
        low, high = min(values), max(values)
        if all(isinstance(v, int) for v in (*values, step)):
            if log and (step != 1 or low <= 0):
                raise ConfigError(f"hydra.sweeper.params: {said}: tag(log, range(...)) needs integers > 0, step 1")
            return IntDistribution(low, high, log=log, step=int(step))
        if log:
            raise ConfigError(f"hydra.sweeper.params: {said}: tag(log, ...) takes interval(...) or an integer range")
        return FloatDistribution(low, high, step=step)
    if log:
        raise ConfigError(f"hydra.sweeper.params: {said}: tag(log, ...) takes interval(...) or an integer range")
    assert isinstance(value, ChoiceSweep | RangeSweep)  # choice(...), shuffle(range(...))
    if bad := [v for v in values if not isinstance(v, CHOICE_TYPES)]:
        raise ConfigError(f"hydra.sweeper.params: {said}: a choice takes numbers, strings and booleans, not {bad[0]!r}")
    return CategoricalDistribution(values)


def _integers(override: Override) -> bool:
    """interval(a, b) written with two integers (Hydra has made floats of them)."""
    found = _INTERVAL.search(override.input_line or "")
    return found is not None and all(_INT.fullmatch(bound) for bound in found.groups())


def override_text(key: str, value: Any) -> str:
    """A drawn value as the override a job gets (strings were encoded for the grammar when parsed)."""
    if isinstance(value, float) and value.is_integer() and not math.isinf(value):
        return f"{key}={value!r}"  # 1.0, not 1: a float key stays a float
    return f"{key}={value}"


def corners(space: Space) -> list[dict[str, Any]]:
    """Draws that show every value of each key once to the job's config (a choice's each value, a range's ends),
    the other keys at their first: what the sweeper composes before it asks a trial."""
    values = {key: _ends(dist) for key, dist in space.items()}
    first = {key: found[0] for key, found in values.items()}
    draws = [first]
    for key, found in values.items():
        draws += [{**first, key: value} for value in found[1:]]
    return draws


def _ends(dist: BaseDistribution) -> list:
    if isinstance(dist, CategoricalDistribution):
        return list(dist.choices)
    assert isinstance(dist, IntDistribution | FloatDistribution)
    return [dist.low, dist.high]


def grid(space: Space) -> dict[str, list]:
    """GridSampler's search space: every value of each distribution (choice, range, an integer interval)."""
    values: dict[str, list] = {}
    for key, dist in space.items():
        if isinstance(dist, CategoricalDistribution):
            values[key] = list(dist.choices)
        elif isinstance(dist, IntDistribution) and not dist.log:
            values[key] = list(range(dist.low, dist.high + 1, dist.step))
        elif isinstance(dist, FloatDistribution) and dist.step is not None:
            count = round((dist.high - dist.low) / dist.step) + 1
            values[key] = [dist.low + i * dist.step for i in range(count)]
        else:
            raise ConfigError(
                f"hydra.sweeper.params: {key}: a grid (optuna.samplers.GridSampler) takes choice(...), range(...) "
                "or an integer interval(...), not a continuous one"
            )
    return values
