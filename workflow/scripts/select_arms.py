"""Select-arms stage (section 13): paired evaluation of every policy, then the pre-registered rule.

`select_arms.py config/selection.toml config/arms/<arm>.toml ... [--k=v ...]`: the
first config is the selection's pre-registration, the others name the arms
(align.stages.selection runs the stage).
"""

from __future__ import annotations

import sys

from align.exit_codes import run_with_exit_codes
from align.stages.selection import run_select_arms


def main() -> None:
    run_select_arms(sys.argv[1:])


if __name__ == "__main__":
    run_with_exit_codes(main, "select_arms")
