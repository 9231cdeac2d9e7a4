"""hydra/sweeper=optuna_study (conf/hydra/sweeper/optuna_study.yaml): the thin Hydra plugin in front of
trainkit.search.sweeper.Study. Optuna and trainkit are imported only when a study runs: Hydra imports this
module on every start, and `import optuna` alone takes a second."""

from typing import Any

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


class OptunaSweeper(Sweeper):
    def __init__(self, **settings: Any) -> None:  # conf/hydra/sweeper/optuna_study.yaml's keys
        from trainkit.search.sweeper import Study

        self.study = Study(**settings)

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.study.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> Any:
        return self.study.sweep(arguments)
