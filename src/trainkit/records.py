"""What rank 0 writes into the run dir when training starts: the composed config (and a data set's files, e.g. a
corpus's vocabulary), a parent's weights and config, a teacher's copy, provenance.json. Written only after every
refusal, so a refused run leaves its dir as it was."""

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from trainkit import config, provenance
from trainkit import teacher as teachers
from trainkit.dist import Dist


def write_start(cfg: DictConfig, run_dir: Path, d: Dist, train_set: Any, chained: Any, teacher: Any, resumed) -> None:
    """Rank 0's records of a run that starts or resumes (resumed: the checkpoint it resumes from, else None)."""
    if not d.is_main:
        return
    config.save(cfg, run_dir, getattr(train_set, "files", {}))
    if chained is not None:  # the parent's weights and config kept with the run, for when its dir is gone
        chained.copy_into(run_dir / "parent")
    teachers.keep(teacher, run_dir)  # its copy in the run dir: a resume, eval.py, predict.py read that
    # provenance.json: commit, diff, versions, command, world size, the parents' own records
    # (a resume: its step and checkpoint; from another run's checkpoint, that run's record)
    provenance.write(run_dir, cfg, d.world_size, *((resumed["progress"]["step"], resumed["path"]) if resumed else ()))
