"""A stop that arrives while a rank's trio run trains cancels the run at its next checkpoint, which
then raises Stopped. Raised instead wherever the main thread was, it could land in trio's own loop
and break the run; a worker thread finishing after that printed "Exception while delivering result
of thread" into the rank's output (seen once in test_signals' SIGHUP case)."""
import subprocess
import sys

RANK = """
import os, signal, time, trio
from zdsl.runtime.proc import guard

guard.guard_rank()


async def train():
    async with trio.open_nursery() as nursery:   # a worker thread the stop abandons, as the executor's waits
        nursery.start_soon(lambda: trio.to_thread.run_sync(time.sleep, 0.3, abandon_on_cancel=True))
        os.kill(os.getpid(), signal.SIGTERM)     # taken by the lifeline thread, which interrupts this one
        start = time.monotonic()
        while time.monotonic() - start < 0.8:    # no checkpoint in here: the stop must not land in it
            pass
        print("ran to the checkpoint", flush=True)
        await trio.sleep(30)

try:
    trio.run(guard.run_stoppable, train)
except guard.Stopped as exc:
    print(f"Stopped: {exc.why}", flush=True)
time.sleep(0.5)                                  # the abandoned thread ends after the run
os._exit(0)                                      # before the lifeline's deadline (3 s)
"""


def test_a_stop_during_a_trio_run_lands_at_its_next_checkpoint_and_a_late_worker_says_nothing():
    proc = subprocess.run([sys.executable, "-c", RANK], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["ran to the checkpoint", "Stopped: stopped by SIGTERM"], proc.stdout
    assert proc.stderr == "", proc.stderr
