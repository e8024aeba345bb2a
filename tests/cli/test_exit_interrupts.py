"""An interrupt that lands where Python cannot raise it (a ``__del__``) still stops the command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: SIGTERM's exception raised inside a ``__del__`` (where a signal sometimes lands: h5py and
#: tqdm objects are freed all the time), then a loop only a delivered interrupt ends
CHILD = """
import signal, sys, time
from embedpipe.cli import exit as ending
sys.unraisablehook = ending._Interrupts.hook
signal.signal(signal.SIGTERM, ending._raise_terminated)
signal.signal(signal.SIGALRM, ending._raise_remembered)
class FreedDuringTheSignal:
    def __del__(self):
        raise ending.Terminated()
FreedDuringTheSignal()
deadline = time.monotonic() + 60
try:
    while time.monotonic() < deadline:
        time.sleep(0.01)
    print("ran on")
except ending.Terminated:
    print("stopped")
"""


def test_a_sigterm_swallowed_in_del_is_delivered_again_and_stops_the_loop() -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120,
                          env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert proc.stdout.strip() == "stopped", (proc.stdout, proc.stderr)
    assert "Exception ignored" not in proc.stderr
