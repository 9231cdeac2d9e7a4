"""hparams_search=: an Optuna study as a Hydra sweeper, in four modules (docs/search.md):

- sweeper.py: the study behind hydra/sweeper=optuna_study (hydra_plugins.trainkit_search): it asks the trials,
  runs them as Hydra jobs (every rank the same trial), tells Optuna their results, and continues a study;
- grammar.py: hydra.sweeper.params' grammar (choice, interval, range, tag(log, ...)) as Optuna distributions;
- studies.py: where a study lives (hydra.sweeper.storage: sqlite, a journal file) and its trials' heartbeats;
- pruning.py: a job's side of hydra.sweeper.pruner: it reports its evaluations and stops when pruned.

This file imports nothing: train.py imports pruning.py, which imports Optuna only when a trial has a pruner."""
