"""The schedules room (conf/sched/<name>.yaml: one file here per schedule family). Yours goes here too.

A schedule is a pure function `f(step, *, total_steps, **settings) -> float`: the multiplier of optim.lr (of each
parameter group's lr) at optimizer step `step` (0 for the first), lengths counted in optimizer steps (rule 6).
Its yaml names it with `_target_` and `_partial_: true`; the keys after that are its settings, its keyword
arguments after `total_steps`, written once: trainkit/options.py types them from the signature (annotations:
types; defaults: defaults), so `sched.warmup_steps=abc` or a misspelt key is refused in one line. The engine adds
`total_steps` (trainer.max_steps, or epochs x steps per epoch) and hands the function to torch's LambdaLR, which
calls it once per optimizer step (trainkit/optim.py's `multiplier`); a resume recomputes every lr from it at the
restored step, so it must depend on nothing but its arguments. Before training the engine reads it at every step of
the run (`optim.survey`): a value below 0 or not finite is refused naming the step, and a run that ends while the
multiplier still rises (a warmup as long as the run) is said in a start line. Its module may declare `Schema` and
`check(cfg)` like any room's (trainkit/options.py reads them; the engine imports no file here by name).

The shipped ones, examples of the form: warmup.py (`constant`, `warmup_cosine`), cycle.py (`one_cycle`).
"""

from trainkit.schedules.cycle import one_cycle
from trainkit.schedules.warmup import constant, warmup_cosine

__all__ = ["constant", "one_cycle", "warmup_cosine"]  # as before the room: saved runs' _target_s, imports
