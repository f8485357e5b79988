import pytest

from kvcached.testing.daemon_proc import DaemonProcess


@pytest.fixture
def daemon():
    process = DaemonProcess().start()
    yield process
    process.cleanup()
