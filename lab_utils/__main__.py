"""``python -m lab_utils``: the command line (:mod:`lab_utils.app.cli`)."""

from lab_utils.app.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
