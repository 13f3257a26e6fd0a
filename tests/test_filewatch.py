"""A model file changed in place under a running gguf peer stops the peer with a clear reason
(``meshinfer.peer.filewatch``), instead of computing with other weights under the old weights
hash or dying of SIGBUS; a file replaced by rename leaves it serving."""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest

from meshinfer.peer import filewatch
from meshinfer.peer.filewatch import FileIdentity, change_in_place
from meshinfer.peer.launch import launch_peer
from meshinfer.peer.node import PeerSettings
from meshinfer.wire import protocol


def test_a_change_in_place_is_told_from_a_replacement(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x" * 100)
    loaded = FileIdentity.of(f)
    assert change_in_place(f, loaded) is None
    with open(f, "r+b") as fh:  # same size, new bytes: the modification time moves
        fh.write(b"y")
    os.utime(f, ns=(loaded.mtime_ns + 10**9, loaded.mtime_ns + 10**9))
    assert "written to" in change_in_place(f, loaded)
    with open(f, "ab") as fh:
        fh.write(b"z" * 28)
    assert "100 -> 128 bytes" in change_in_place(f, loaded)
    g = tmp_path / "new.gguf"
    g.write_bytes(b"w" * 50)
    os.replace(g, f)  # a new file by rename: the old one stays mapped, intact
    assert change_in_place(f, FileIdentity.of(tmp_path / "m.gguf")) is None
    again = FileIdentity.of(f)
    f.unlink()
    assert change_in_place(f, again) is None and FileIdentity.of(f) is None


async def _peer_on_a_copy(tiny, tmp_path, monkeypatch, dtype: str):
    """(the copy of the tiny model a new peer at ``dtype`` serves, the peer), checking every 50 ms."""
    model = tmp_path / "model.gguf"
    shutil.copyfile(tiny[0], model)
    monkeypatch.setattr(filewatch, "MODEL_WATCH_INTERVAL_S", 0.05)
    return model, await launch_peer(str(model), None, dtype=dtype, settings=PeerSettings(gossip_interval_s=0.1),
                                    key_path=str(tmp_path / "k.pem"), home=str(tmp_path), warmup=False)


@pytest.mark.parametrize("how", ["truncate", "rename"])
async def test_a_gguf_peer_stops_when_its_model_file_changes_in_place(tiny, tmp_path, monkeypatch, how):
    path = tiny[0]
    model, peer = await _peer_on_a_copy(tiny, tmp_path, monkeypatch, "gguf")
    try:
        assert peer.state == protocol.READY
        if how == "rename":
            fresh = tmp_path / "fresh.gguf"
            shutil.copyfile(path, fresh)
            os.replace(fresh, model)
            with pytest.raises(asyncio.TimeoutError):  # 10 checks: nothing to stop for
                await asyncio.wait_for(peer.stopped.wait(), 0.5)
            assert peer.state == protocol.READY and peer.fatal is None
        else:
            with open(model, "r+b") as fh:
                fh.truncate(model.stat().st_size // 2)
            await asyncio.wait_for(peer.stopped.wait(), 10)
            assert peer.state == protocol.DRAINING
            assert "changed in place" in peer.fatal and "model.gguf" in peer.fatal
    finally:
        await peer.close()


async def test_an_f32_peer_does_not_watch_its_file(tiny, tmp_path, monkeypatch):
    """f32 copies the weights out of the file at load, so a later change cannot reach it."""
    model, peer = await _peer_on_a_copy(tiny, tmp_path, monkeypatch, "f32")
    try:
        with open(model, "r+b") as fh:
            fh.truncate(100)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(peer.stopped.wait(), 0.5)
        assert peer.state == protocol.READY
    finally:
        await peer.close()
