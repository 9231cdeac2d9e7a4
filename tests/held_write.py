"""`python tests/held_write.py <checkpoint name> <marker> src/train.py <args>`: train.py as on the command line, its
checkpoint.async write of `<checkpoint name>` (e.g. step_00000006) held in flight for good: once it is, `<marker>`
exists, and a test kills the process mid-write (tests/test_checkpoint_async.py). Test-side only: trainkit's planner
is wrapped here, before train.py runs."""

import runpy
import sys
import time
from pathlib import Path

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from trainkit import checkpoint


class HeldPlanner(DefaultSavePlanner):
    """DCP's planner, whose set-up (in the writing thread, before any byte is written) never returns for NAME."""

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
        if storage_meta is not None and Path(str(storage_meta.checkpoint_id)).name == f"{NAME}.tmp":
            Path(MARKER).touch()
            while True:
                time.sleep(1)
        return super().set_up_planner(state_dict, storage_meta, is_coordinator)


if __name__ == "__main__":
    NAME, MARKER = sys.argv[1], sys.argv[2]
    checkpoint.DefaultSavePlanner = HeldPlanner  # type: ignore[misc]
    sys.argv = sys.argv[3:]
    runpy.run_path(sys.argv[0], run_name="__main__")
