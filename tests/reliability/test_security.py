"""Security defaults of the local launcher: rendezvous in a private directory that is removed
afterwards, gloo bound to the loopback interface, the collective timeout passed to every rank."""

import os
import stat
import tempfile

import hgraph


def _rank_environment():
    import torch.distributed as dist

    return os.environ.get("GLOO_SOCKET_IFNAME"), os.environ.get("HGRAPH_COMM_TIMEOUT"), dist.get_backend()


def test_launcher_rendezvous_is_private_and_local(monkeypatch):
    made = []
    real_mkdtemp = tempfile.mkdtemp

    def recording_mkdtemp(*args, **kwargs):
        path = real_mkdtemp(*args, **kwargs)
        made.append((path, stat.S_IMODE(os.stat(path).st_mode)))
        return path

    monkeypatch.setattr(tempfile, "mkdtemp", recording_mkdtemp)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    result = hgraph.launch(_rank_environment, 2, timeout=60, comm_timeout=7)
    assert result == [("lo", "7", "gloo")] * 2
    (path, mode), = made
    assert mode == 0o700  # only this user can reach the file:// store
    assert not os.path.exists(path)  # removed after the run
