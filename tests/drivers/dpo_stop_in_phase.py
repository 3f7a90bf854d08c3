"""workflow/scripts/dpo.py whose rank 0 sends its launcher SIGTERM as a phase after training
begins, as Slurm's pre-timeout signal would: `dpo_stop_in_phase.py PHASE ARGS...`, PHASE
`export` or `evaluate`, ARGS the stage's own."""

import os
import runpy
import signal
import sys
import time
from pathlib import Path

import align.stages.dpo as stage

PHASES = {"export": "export_policy", "evaluate": "score_pairs"}
DPO = Path(__file__).resolve().parents[2] / "workflow" / "scripts" / "dpo.py"


def signalling_first(name: str):
    real = getattr(stage, name)
    sent = []

    def wrapped(*args, **kwargs):
        if not sent and int(os.environ.get("RANK", "0")) == 0:
            os.kill(os.getppid(), signal.SIGTERM)  # the launcher, which forwards it to every rank
            time.sleep(1.0)  # every rank's handler has it before the phase's work begins
        sent.append(True)
        return real(*args, **kwargs)

    return wrapped


phase, *sys.argv[1:] = sys.argv[1:]
setattr(stage, PHASES[phase], signalling_first(PHASES[phase]))
sys.argv[0] = str(DPO)
runpy.run_path(str(DPO), run_name="__main__")
