"""Lock files: one holder at a time, dead or lapsed holders broken exactly once, leases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

from batchgen.io import locks


def dead_pid() -> int:
    ended = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(ended.stdout)


def plant(path, **holder) -> None:
    """A lock file as another process would have left it."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    base = {"host": locks.HOST, "boot_id": locks.BOOT_ID, "pid": 1, "start": None, "token": "t"}
    with open(path, "w") as f:
        json.dump({**base, **holder}, f)


def test_one_holder_then_released(tmp_path):
    path = locks.lock_path(str(tmp_path), "part-00001.lock")
    held = locks.try_acquire(path, "shard", task="0/2")
    assert isinstance(held, locks.HeldLock) and held.still_ours()
    # Our own lock seen from this process: live, and its file is never opened (fcntl).
    other = locks.try_acquire(path, "shard")
    assert isinstance(other, locks.LockInfo) and other.live and other.holder["task"] == "0/2"
    held.release()
    assert not os.path.exists(path)
    again = locks.try_acquire(path, "shard")
    assert isinstance(again, locks.HeldLock)
    again.release()


def test_live_process_of_this_host_blocks(tmp_path):
    path = locks.lock_path(str(tmp_path), "part-00002.lock")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        plant(path, pid=proc.pid, start=locks.process_start(proc.pid))
        got = locks.try_acquire(path, "shard")
        assert isinstance(got, locks.LockInfo) and got.live
        # The same pid with another start time is a reused pid: that holder is gone.
        plant(path, pid=proc.pid, start=(locks.process_start(proc.pid) or 0) + 1)
        got = locks.try_acquire(path, "shard")
        assert isinstance(got, locks.HeldLock)
        got.release()
    finally:
        proc.kill()
        proc.wait()


def test_dead_holder_and_lapsed_lease_are_broken(tmp_path):
    path = locks.lock_path(str(tmp_path), "part-00003.lock")
    plant(path, pid=dead_pid())
    got = locks.try_acquire(path, "shard")
    assert isinstance(got, locks.HeldLock) and got.holder["pid"] == os.getpid()
    got.release()
    # Another host: alive as far as we can tell, until its lease lapses.
    plant(path, host="elsewhere", boot_id="b", pid=4242)
    assert isinstance(locks.try_acquire(path, "shard", lease_s=60), locks.LockInfo)
    old = time.time() - 61
    os.utime(path, (old, old))
    got = locks.try_acquire(path, "shard", lease_s=60)
    assert isinstance(got, locks.HeldLock)
    got.release()


def test_renewal_keeps_a_lease_and_a_broken_lock_is_noticed(tmp_path):
    path = locks.lock_path(str(tmp_path), "part-00004.lock")
    held = locks.try_acquire(path, "shard")
    old = time.time() - 100
    os.utime(path, (old, old))
    held.renew()
    assert time.time() - os.stat(path).st_mtime < 5
    # A paused holder's lease lapses; another process breaks the lock and takes the shard.
    os.utime(path, (old, old))
    locks._HELD.pop(held._key)  # seen as another process would see it
    info = locks.inspect(path, lease_s=60)
    assert info is not None and not info.live
    locks.break_stale(info)
    taker = locks.try_acquire(path, "shard")
    assert isinstance(taker, locks.HeldLock)
    assert not held.still_ours()
    held.release()  # must not remove the new holder's lock
    assert os.path.exists(path) and taker.still_ours()
    taker.release()


def test_racing_breakers_leave_exactly_one_holder(tmp_path):
    out = str(tmp_path)
    for round_ in range(10):
        path = locks.lock_path(out, f"part-{round_:05d}.lock")
        plant(path, pid=dead_pid())
        got: list = []
        barrier = threading.Barrier(4)

        def take(path=path, barrier=barrier, got=got):
            barrier.wait()
            got.append(locks.try_acquire(path, "shard"))

        threads = [threading.Thread(target=take) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        held = [g for g in got if isinstance(g, locks.HeldLock)]
        assert len(held) == 1, got
        held[0].release()


def test_tidy_breaks_stale_locks_and_removes_the_dir(tmp_path):
    out = str(tmp_path)
    plant(locks.lock_path(out, "run-x.lock"), pid=dead_pid())
    keeper = locks.LeaseKeeper(lease_s=8)
    held = locks.try_acquire(locks.lock_path(out, "part-00000.lock"), "shard")
    keeper.add(held)
    locks.tidy(out)
    assert os.listdir(os.path.join(out, locks.LOCK_DIR)) == ["part-00000.lock"]
    keeper.close()
    locks.tidy(out)
    assert not os.path.exists(os.path.join(out, locks.LOCK_DIR))


def test_owned_locks_live_while_their_owner_runs_and_are_taken_over(tmp_path):
    """A data parallel worker's lock (set_owner: its parent) outlives the worker until the
    owner breaks it or takes it over in one rename."""
    path = locks.lock_path(str(tmp_path), "part-00004.lock")
    worker = (
        "import sys; from batchgen.io import locks\n"
        f"locks.set_owner({os.getpid()})\n"
        "held = locks.try_acquire(sys.argv[1], 'shard')\n"
        "assert isinstance(held, locks.HeldLock)\n"
        "import os; os._exit(0)  # dies holding it\n"
    )
    subprocess.run([sys.executable, "-c", worker, path], check=True)
    left = locks.inspect(path, locks.DEFAULT_LEASE_S)
    assert left.live and left.holder["owner"] == os.getpid() and left.holder["pid"] != os.getpid()
    assert isinstance(locks.try_acquire(path, "shard"), locks.LockInfo)  # nobody breaks it
    mine = locks.take_over(left, "set aside", task="0/1")
    assert mine.still_ours() and locks.inspect(path, 60).holder["what"] == "set aside"
    mine.release()
    assert not os.path.exists(path)
    # The owner gone: such a lock is stale like any other.
    plant(path, pid=os.getpid(), owner=dead_pid(), owner_start=None)
    assert not locks.inspect(path, 60).live
