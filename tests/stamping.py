"""The fixture of the in-process tests (tests/core, tests/server) that play the engine."""

import pytest

from kvcached.core.daemon import DaemonState


@pytest.fixture(autouse=True)
def writers_stamp_their_pages(monkeypatch):
    """These tests play the engine in process: a commit stands for a save whose copy is complete,
    so the committed pages carry the lease's write generation, as the engine's stamp leaves them
    (proto.generations). Tests of the generations themselves stamp, or not, explicitly."""
    commit = DaemonState.commit

    def commit_written(self, request, *args, **kwargs):
        lease = self.leases.get(request.lease_id)
        if lease is not None and lease.session_id == request.session_id and request.page_ids:
            written = [p for p in request.page_ids if p in lease.private_page_ids]
            self.namespaces[lease.namespace_id].generations.shared[written] = lease.generation
        return commit(self, request, *args, **kwargs)

    monkeypatch.setattr(DaemonState, "commit", commit_written)
