"""The fixture of the in-process tests (tests/core, tests/server) that play the engine."""

import pytest

from kvcached.core.daemon import DaemonState


@pytest.fixture(autouse=True)
def writers_stamp_their_pages(monkeypatch):
    """These tests play the engine in process: a commit stands for a save whose copy is complete,
    so the committed pages carry the lease's write generation, as the engine's stamp leaves them
    (proto.generations). Tests of the generations themselves stamp, or not, explicitly."""
    commit_backup = DaemonState.commit_backup

    def commit_written(self, session_id, lease_id, host_page_ids, *args, **kwargs):
        lease = self.leases.get(lease_id)
        if lease is not None and lease.session_id == session_id and host_page_ids:
            written = [p for p in host_page_ids if p in lease.private_page_ids]
            self.namespaces[lease.namespace_id].generations.shared[written] = lease.generation
        return commit_backup(self, session_id, lease_id, host_page_ids, *args, **kwargs)

    monkeypatch.setattr(DaemonState, "commit_backup", commit_written)
