"""Guarantees of the search that no other test held when a bug was planted (issue 45's audit)."""

import optuna
from omegaconf import OmegaConf

from trainkit.search.pruning import PRUNED_AT, Trial


class Ranks:
    """What Trial uses of Dist: rank 0 or not, and the all-reduced any() of every rank's opinion."""

    def __init__(self, is_main: bool, another_rank_prunes: bool):
        self.is_main, self.another_rank_prunes = is_main, another_rank_prunes

    def any(self, flag: bool) -> bool:
        return flag or self.another_rank_prunes


def test_every_rank_prunes_when_any_rank_s_pruner_prunes_and_none_alone(tmp_path):
    # DESIGN rule 18: this rank's pruner (NopPruner) says no; another rank's says yes: this rank stops too
    # (a rank deciding alone would leave the others in their next collective).
    url = f"sqlite:///{tmp_path / 'study.db'}"
    optuna.create_study(study_name="s", storage=url).ask()
    sweeper = OmegaConf.create({"pruner": {"_target_": "optuna.pruners.NopPruner"}, "storage": url, "study_name": "s"})
    assert not Trial(sweeper, 0, "val/acc", Ranks(True, another_rank_prunes=False)).prunes({"val/acc": 0.5}, 10)
    assert Trial(sweeper, 0, "val/acc", Ranks(True, another_rank_prunes=True)).prunes({"val/acc": 0.5}, 20)
    stored = optuna.load_study(study_name="s", storage=url).trials[0]
    assert stored.intermediate_values == {10: 0.5, 20: 0.5} and stored.user_attrs[PRUNED_AT] == 20
