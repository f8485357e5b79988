"""Process identity (proto.procfs), on real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from proto.procfs import ProcessIdentity, own_identity, pid_namespace_id, running, start_time


def test_own_identity_is_this_process_in_this_pid_namespace():
    """pid, the inode of /proc/self/ns/pid and field 22 of /proc/self/stat."""
    identity = own_identity()
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    assert identity == ProcessIdentity(os.getpid(), os.stat("/proc/self/ns/pid").st_ino, int(fields[22 - 3]))
    assert identity.pid_namespace_id == pid_namespace_id() and identity.process_start_time == start_time()


def test_an_unknown_part_does_not_tell_two_identities_apart():
    """Another pid, namespace or start time is another process; 0 (unknown) on either side agrees."""
    one = ProcessIdentity(1234, 77, 5000)
    assert one.same_process(ProcessIdentity(1234, 77, 5000))
    assert one.same_process(ProcessIdentity(1234)) and ProcessIdentity(1234).same_process(one)
    assert one.same_process(ProcessIdentity(1234, 0, 5000)) and one.same_process(ProcessIdentity(1234, 77, 0))
    assert not one.same_process(ProcessIdentity(1235, 77, 5000))
    assert not one.same_process(ProcessIdentity(1234, 78, 5000))
    assert not one.same_process(ProcessIdentity(1234, 77, 5001))


def test_a_process_runs_until_it_exits_and_a_later_start_time_is_not_it():
    """running(pid, start time) holds for a live child; not for another start time, nor once the
    child is a zombie (SIGKILL, not reaped), nor once it is reaped."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = start_time(child.pid)
        assert started is not None and running(child.pid, started)
        assert not running(child.pid, started + 1)
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while running(child.pid, started):          # a zombie until reaped below
            assert time.monotonic() < deadline, "a killed child still runs"
            time.sleep(0.01)
        assert os.path.exists(f"/proc/{child.pid}")
    finally:
        child.kill()
        child.wait()
    assert not running(child.pid, started)
