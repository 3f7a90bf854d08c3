"""A training stage's script whose rank 0 sends its launcher SIGTERM as a phase after
training begins, as Slurm's pre-timeout signal would: `stop_in_phase.py STAGE PHASE ARGS...`,
STAGE `sft` or `dpo`, PHASE `export` or `evaluate`, ARGS the stage's own."""

import importlib
import os
import runpy
import signal
import sys
import time
from pathlib import Path

# What each stage calls first in the phase.
PHASES = {
    "dpo": {"export": "export_policy", "evaluate": "score_pairs"},
    "sft": {"export": "export_policy", "evaluate": "mean_nll"},
}
SCRIPTS = Path(__file__).resolve().parents[2] / "workflow" / "scripts"


def signalling_first(module, name: str):
    real = getattr(module, name)
    sent = []

    def wrapped(*args, **kwargs):
        if not sent and int(os.environ.get("RANK", "0")) == 0:
            os.kill(os.getppid(), signal.SIGTERM)  # the launcher, which forwards it to every rank
            time.sleep(1.0)  # every rank's handler has it before the phase's work begins
        sent.append(True)
        return real(*args, **kwargs)

    return wrapped


stage, phase, *sys.argv[1:] = sys.argv[1:]
module = importlib.import_module(f"align.stages.{stage}")
setattr(module, PHASES[stage][phase], signalling_first(module, PHASES[stage][phase]))
script = SCRIPTS / f"{stage}.py"
sys.argv[0] = str(script)
runpy.run_path(str(script), run_name="__main__")
