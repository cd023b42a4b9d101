"""ProgressThread: calls progress() at the interval it returns, at once on wake(), never after stop(); an
exception ends the thread and is kept for the owner to raise."""
import threading
import time

from disagg.worker.kv_transfer.nixl_progress import ProgressThread


def test_wake_runs_progress_at_once_and_stop_ends_it():
    calls = []
    thread = ProgressThread(lambda: calls.append(time.monotonic()) or 60.0, name="t")  # else: once a minute
    thread.start()
    deadline = time.monotonic() + 5
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    t = time.monotonic()
    thread.wake()
    while len(calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(calls) == 2 and calls[1] - t < 1.0
    thread.stop()
    assert not thread.alive
    n = len(calls)
    time.sleep(0.05)
    assert len(calls) == n


def test_an_exception_ends_the_thread_and_is_kept():
    done = threading.Event()

    def progress() -> float:
        done.set()
        raise RuntimeError("nixl went away")

    thread = ProgressThread(progress, name="t")
    thread.start()
    assert done.wait(5)
    thread.stop()
    assert isinstance(thread.error, RuntimeError) and "nixl went away" in str(thread.error)
