"""A study's trial that reports its evaluations and may be pruned (hydra.sweeper.pruner, sweeper.py).

At each evaluation the job reports the monitored value (already all-reduced: the same float on every
rank) at its optimizer step to its trial, and every rank asks the pruner; the ranks then agree through
one all-reduce (rule 18, docs/design.md): pruned when any rank's pruner says so. Each rank asking alone and
stopping alone hangs the others at their next collective (optuna-integration #183, #223).

Rank 0 alone writes the report; every rank's pruner sees the trial with this step's value in it
(added here, not read back), so no rank depends on when rank 0's write reaches the storage. A resumed
trial does not report a step it has reported (a resume re-evaluates the steps after its checkpoint).
A pruned run ends like an early stop (train.py): its checkpoint and best weights, its row, exit 0;
rank 0 marks the trial `pruned_at` (a user attribute), from which the sweeper tells Optuna PRUNED.
Optuna is imported only by a trial with a pruner (`import optuna` takes a second; train.py imports this)."""

from typing import TYPE_CHECKING, Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

if TYPE_CHECKING:
    from optuna.trial import FrozenTrial

PRUNED_AT = "pruned_at"  # the trial's user attribute: the step its run was pruned at
SWEEPER = "trainkit_search"  # hydra.sweeper._target_ of hydra/sweeper=optuna_study


class Trial:
    def __init__(self, sweeper: DictConfig, number: int, monitor: str, d: Any):
        self.monitor, self.d, self.number = monitor, d, number
        import optuna

        from trainkit.search import studies

        pruner = instantiate(sweeper.pruner)
        self.storage = studies.storage(sweeper.storage)  # Optuna's public BaseStorage API from here on
        self.study = optuna.load_study(study_name=sweeper.study_name, storage=self.storage, pruner=pruner)
        study_id = self.storage.get_study_id_from_name(sweeper.study_name)
        self.trial_id = self.storage.get_trial_id_from_study_id_trial_number(study_id, number)
        self.reason = ""

    @classmethod
    def of_job(cls, monitor: str | None, d: Any) -> "Trial | None":
        """This job's trial when it is one of a study with a pruner (hydra/sweeper=optuna_study), else None."""
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return None
        hydra_cfg = HydraConfig.get()
        sweeper = hydra_cfg.sweeper
        if SWEEPER not in str(sweeper.get("_target_")) or OmegaConf.select(sweeper, "pruner") is None:
            return None
        assert monitor is not None  # the sweeper refuses a pruner without checkpoint.monitor
        return cls(sweeper, int(hydra_cfg.job.num), monitor, d)

    def prunes(self, metrics: dict[str, float], step: int) -> bool:
        """Report this evaluation (rank 0) and decide, every rank together, whether the run stops here."""
        value = metrics[self.monitor]
        stored = self.storage.get_trial(self.trial_id)
        reported = dict(stored.intermediate_values)
        if self.d.is_main and step not in reported:  # a resumed trial: never a step twice
            self.storage.set_trial_intermediate_value(self.trial_id, step, value)
        reported.setdefault(step, value)
        opinion = bool(self.study.pruner.prune(self.study, _with_values(stored, reported, self.trial_id)))
        if not self.d.any(opinion):  # one all-reduce: any rank's pruner prunes every rank
            return False
        if self.d.is_main:
            self.storage.set_trial_user_attr(self.trial_id, PRUNED_AT, step)
        self.reason = f"{self.monitor} {value:.4g} (hydra.sweeper.pruner={type(self.study.pruner).__name__})"
        return True

    def line(self, step: int) -> str:
        return f"pruned at step {step}: {self.reason}"


def _with_values(trial: "FrozenTrial", values: dict[int, float], trial_id: int) -> "FrozenTrial":
    """The stored trial with these intermediate values (FrozenTrial's public constructor)."""
    from optuna.trial import FrozenTrial

    return FrozenTrial(
        number=trial.number,
        state=trial.state,
        value=None,
        datetime_start=trial.datetime_start,
        datetime_complete=trial.datetime_complete,
        params=trial.params,
        distributions=trial.distributions,
        user_attrs=trial.user_attrs,
        system_attrs=trial.system_attrs,
        intermediate_values=values,
        trial_id=trial_id,
    )
