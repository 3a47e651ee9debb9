"""A whole job the way a scheduler runs it: ``python fit_resume_job.py DIRPATH`` fits 2 CPU ranks (Lightning's
own launcher starts the second) for an epoch with async ``sharded`` checkpoints, then resumes from
``"last"`` for a second epoch in the same processes, and exits. tests/faults/test_clean_exit.py runs it
many times: every run must exit 0.
"""

from __future__ import annotations

import sys


def main(dirpath: str) -> None:
    from checkpoint_cases import fit, make_trainer

    fit(make_trainer("sharded", dirpath, 1, start_method="popen"))
    fit(make_trainer("sharded", dirpath, 2, start_method="popen"), ckpt_path="last", perturb=True)


if __name__ == "__main__":
    main(sys.argv[1])
