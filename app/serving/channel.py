"""A direct channel from a target replica to its Drafter replica on the same Ray node: a Unix socket.

A drafter call through Serve's handle crosses Serve's request router and its gRPC data plane: about 1.5 ms on an idle
host, and several times that while the engine's threads hold the cores, against a round of a few tens of
milliseconds. With ``drafter_channel`` (on by default) a target replica asks its pinned Drafter replica once, through
the handle, where a Unix socket the replica listens on is (``ChannelAddress``), and sends its calls there: one
length-prefixed pickle each way, between the two replicas' event loops, with no size limit.

Owns: the listening side (``ChannelServer``: a socket in a fresh directory only this user can enter, so only this
user's processes can call it), the calling side (``ChannelClient``: one call at a time, in order), the address and
the framing.
Does not own: choosing the replica, a call's timeout, or what a failure does to requests (``drafter_client.py``).
"""

from __future__ import annotations

import asyncio
import os
import pickle
import shutil
import socket
import struct
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import ray

_LENGTH = struct.Struct("!Q")  # a frame: its pickle's length in bytes, then the pickle
_PREFIX, _SOCKET = "dspark-drafter-", "channel.sock"  # a channel's directory (in the temporary folder) and socket
STALE_AFTER_S = 60.0  # a channel directory younger than this is never swept (its replica may be starting)


class ChannelClosedError(ConnectionError):
    """The channel's other end went away (the Drafter replica stopped, or its connection broke) mid-call, or nothing
    listens at the path a replica on this node gave (it stopped since)."""


@dataclass(frozen=True)
class ChannelAddress:
    """Where a Drafter replica's channel listens (``DrafterReplica.channel``)."""

    node_id: str | None  # the replica's Ray node (``node_id()``): only processes of that node can reach the socket
    path: str


def node_id() -> str | None:
    """This process's Ray node id (None outside Ray): a channel is reachable from processes of its own node."""
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next object on ``reader``.

    Raises:
        asyncio.IncompleteReadError: the other end closed the connection.
    """
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    return pickle.loads(await reader.readexactly(length))


def _frame(obj: Any) -> bytes:
    """``obj`` as a frame (pickle protocol 5).

    Raises:
        Whatever pickling ``obj`` raises.
    """
    data = pickle.dumps(obj, protocol=5)
    return _LENGTH.pack(len(data)) + data


async def write_frame(writer: asyncio.StreamWriter, obj: Any) -> None:
    """Send ``obj`` on ``writer`` and wait until the transport takes it."""
    writer.write(_frame(obj))
    await writer.drain()


def sweep_stale_channels(folder: str) -> list[str]:
    """Remove the channel directories in ``folder`` that replicas killed outright (no shutdown hook ran) left: this
    user's ``dspark-drafter-*`` directories, last changed over ``STALE_AFTER_S`` ago (so never one a replica is
    starting to listen in), whose socket refuses connections (nobody listens) or that hold none. Returns the
    directories removed."""
    removed = []
    for entry in os.scandir(folder):
        if not entry.name.startswith(_PREFIX) or not entry.is_dir(follow_symlinks=False):
            continue
        info = entry.stat(follow_symlinks=False)
        if info.st_uid != os.getuid() or time.time() - info.st_mtime < STALE_AFTER_S:
            continue
        path = os.path.join(entry.path, _SOCKET)
        if os.path.exists(path):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(0.5)  # a live listener with a full backlog makes a connect wait
                try:
                    probe.connect(path)
                    continue  # a live replica's
                except (ConnectionRefusedError, FileNotFoundError):
                    pass
                except OSError:  # timed out, or another refusal: it may be alive
                    continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


def _sendable(err: Exception) -> Exception:
    """``err`` if it pickles, else a ``RuntimeError`` carrying its type and message."""
    try:
        pickle.dumps(err, protocol=5)
        return err
    except Exception:  # an exception holding something that does not pickle: its text still says what failed
        return RuntimeError(f"{type(err).__name__}: {err}")


class ChannelServer:
    """The Drafter replica's side: answers each frame ``args`` with ``handler(*args)``'s result, or its exception.

    Args:
        handler: the coroutine function a call runs (``DrafterReplica.draft``), on the server's event loop.
    """

    def __init__(self, handler: Callable[..., Awaitable[Any]]) -> None:
        self._handler = handler
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()  # open connections, closed with the server
        self._dir: str | None = None
        self._starting = asyncio.Lock()  # two targets asking at once get one listener
        self.path: str | None = None

    async def start(self) -> str:
        """Listen (once; later calls return the same path) and return the socket's path; first sweep away the
        channels of replicas killed outright (``sweep_stale_channels``).

        Raises:
            OSError: no socket could be made (the temporary directory is full or read-only, or its path is too long
                for a Unix socket); nothing is left behind.
        """
        async with self._starting:
            if self._server is None:
                sweep_stale_channels(tempfile.gettempdir())
                folder = tempfile.mkdtemp(prefix=_PREFIX)  # mode 0700: this user only
                path = os.path.join(folder, _SOCKET)
                try:
                    self._server = await asyncio.start_unix_server(self._serve, path=path)
                except BaseException:
                    shutil.rmtree(folder, ignore_errors=True)
                    raise
                self._dir, self.path = folder, path
        return self.path

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection: frames answered in order until the caller closes it."""
        self._writers.add(writer)
        try:
            while True:
                try:
                    args = await read_frame(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                try:
                    data = _frame(("reply", await self._handler(*args)))
                except Exception as err:  # the caller raises it (a reply that does not pickle too)
                    data = _frame(("error", _sendable(err)))
                writer.write(data)
                try:
                    await writer.drain()
                except ConnectionError:  # the caller gave up on this call (timeout) and closed the connection
                    return
        finally:
            self._writers.discard(writer)
            writer.close()

    def close(self) -> None:
        """Stop listening, close the open connections (their callers see ``ChannelClosedError``) and remove the
        socket's directory. The next ``start`` listens on a new path."""
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.close()
            shutil.rmtree(self._dir, ignore_errors=True)
            self._server = self._dir = self.path = None


class ChannelClient:
    """The target replica's side of one connection: ``call`` sends its arguments and returns the handler's result.

    Calls run one at a time, in order. After a call that failed in transit (``ChannelClosedError``) or was cancelled
    (a timeout), the connection's state is unknown: close it and open another.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self._lock = asyncio.Lock()

    @classmethod
    async def connect(cls, path: str) -> "ChannelClient":
        """Connect to the server listening at ``path`` (on this node).

        Raises:
            ChannelClosedError: nothing listens there (the replica stopped since it gave the path).
        """
        try:
            return cls(*await asyncio.open_unix_connection(path))
        except OSError as err:
            raise ChannelClosedError(f"no drafter channel at {path} ({type(err).__name__}: {err})") from err

    async def call(self, *args: Any) -> Any:
        """The handler's result for ``args``.

        Raises:
            ChannelClosedError: the connection broke or the server went away before answering.
            Exception: what the handler raised, as itself (or a ``RuntimeError`` with its text if it did not pickle).
        """
        async with self._lock:
            try:
                await write_frame(self._writer, args)
                kind, value = await read_frame(self._reader)
            except (asyncio.IncompleteReadError, ConnectionError) as err:
                raise ChannelClosedError(f"the drafter channel closed mid-call ({type(err).__name__})") from err
        if kind == "error":
            raise value
        return value

    def close(self) -> None:
        """Close the connection (the server ends its side)."""
        self._writer.close()
