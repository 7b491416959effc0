"""The drafter channel (app/serving/channel.py): answers in order, errors as themselves, a private socket, and a
close its callers notice."""

from __future__ import annotations

import asyncio
import os
import pathlib
import shutil
import socket
import stat
import tempfile
import threading
import time

import pytest
import torch

from app.serving.channel import ChannelClient, ChannelClosedError, ChannelServer


class _Unpicklable(Exception):
    def __init__(self) -> None:
        super().__init__("holds a lock")
        self.lock = threading.Lock()


@pytest.fixture
def short_tmp(monkeypatch) -> pathlib.Path:
    """A fresh temporary folder for the channels, with a short path: a Unix socket's path has at most 107 bytes, and
    pytest's own ``tmp_path`` under xdist passes that."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="ch-"))
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


async def _handler(kind: str, value):
    if kind == "fail":
        raise ValueError(f"bad value {value!r}")
    if kind == "unpicklable":
        raise _Unpicklable()
    await asyncio.sleep(0.02 if value.numel() == 1 else 0)  # the first call's answer comes last
    return value * 2


def test_calls_are_answered_in_order_and_errors_arrive_as_themselves(short_tmp):
    """Concurrent calls on one connection each get their own answer; the handler's errors arrive as themselves."""
    async def main() -> None:
        server = ChannelServer(_handler)
        path, again = await asyncio.gather(server.start(), server.start())
        assert again == path and await server.start() == path  # listens once, even when asked twice at once
        assert len(list(short_tmp.iterdir())) == 1
        client = await ChannelClient.connect(path)
        values = [torch.arange(n, dtype=torch.float32) for n in (1, 5, 100_000)]
        answers = await asyncio.gather(*[client.call("double", v) for v in values])
        assert all(torch.equal(a, 2 * v) for a, v in zip(answers, values))
        with pytest.raises(ValueError, match="bad value 3"):
            await client.call("fail", 3)
        with pytest.raises(RuntimeError, match="_Unpicklable: holds a lock"):
            await client.call("unpicklable", None)
        assert torch.equal(await client.call("double", torch.ones(2)), torch.full((2,), 2.0))  # still usable
        client.close()
        server.close()

    asyncio.run(main())


def test_the_socket_is_private_and_a_close_reaches_the_callers(short_tmp):
    async def main() -> None:
        server = ChannelServer(_handler)
        path = await server.start()
        folder = os.path.dirname(path)
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700  # only this user's processes can connect
        client = await ChannelClient.connect(path)
        assert torch.equal(await client.call("double", torch.ones(1)), torch.full((1,), 2.0))
        server.close()
        assert not os.path.exists(folder)
        with pytest.raises(ChannelClosedError, match="closed mid-call"):
            await client.call("double", torch.ones(1))
        with pytest.raises(ChannelClosedError, match="no drafter channel at"):
            await ChannelClient.connect(path)
        again = await server.start()
        assert again != path
        client = await ChannelClient.connect(again)
        assert torch.equal(await client.call("double", torch.ones(1)), torch.full((1,), 2.0))
        client.close()
        server.close()

    asyncio.run(main())


def test_a_socket_that_cannot_be_made_leaves_nothing_behind(monkeypatch, tmp_path):
    """A path too long for a Unix socket (a long TMPDIR) fails ``start`` with the OS's error, and its folder goes."""
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))

    async def main() -> None:
        server = ChannelServer(_handler)
        with pytest.raises(OSError):
            await server.start()
        assert list(deep.iterdir()) == [] and server.path is None

    asyncio.run(main())


def test_channels_left_by_killed_replicas_are_swept_at_the_next_start(short_tmp):
    """A replica killed outright leaves its directory and socket: the next replica to listen removes it once it is a
    minute old, and only it (a live replica's channel, a directory just made, another program's files stay)."""
    stale = short_tmp / "dspark-drafter-dead"
    stale.mkdir()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:  # bound, then closed without unlinking
        dead.bind(str(stale / "channel.sock"))
    empty_old, empty_new, other = (short_tmp / "dspark-drafter-old"), (short_tmp / "dspark-drafter-new"), short_tmp / "x"
    for folder in (empty_old, empty_new, other):
        folder.mkdir()
    for folder in (stale, empty_old, other):
        os.utime(folder, (time.time() - 120, time.time() - 120))

    async def main() -> None:
        live = ChannelServer(_handler)
        live_path = await live.start()
        assert not stale.exists() and not empty_old.exists() and empty_new.exists() and other.exists()
        os.utime(os.path.dirname(live_path), (time.time() - 120, time.time() - 120))
        second = ChannelServer(_handler)
        await second.start()  # sweeps again: the live channel stays, however old
        client = await ChannelClient.connect(live_path)
        assert torch.equal(await client.call("double", torch.ones(1)), torch.full((1,), 2.0))
        client.close()
        live.close()
        second.close()

    asyncio.run(main())
