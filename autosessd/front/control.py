"""The control socket (DESIGN §5): a Unix stream socket serving protocol.py to autosessctl
and to serving layers that use the turn hook.

Socket hygiene: the parent directory is created 0700 (0750 with control.group); the
socket is bound under a restrictive umask (0600, or 0660 with a group) rather than
chmod-ed after the fact; a socket file left by a dead daemon is detected by trying to
connect and replaced, one that answers belongs to a running daemon and stops the start;
the file is removed at exit. Every connection's peer credentials are checked (same uid,
root, or a member of control.group); anyone else gets `forbidden` and is closed.

Each connection may send several requests, one per line; a line over MAX_REQUEST, a
connection idle for IDLE_TIMEOUT_S, or more than MAX_CONNECTIONS at once get an error
and are closed. Requests are served concurrently: a long park does not block `status`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import grp
import logging
import os
import pwd
import socket
import stat
import struct
import sys
from typing import Any, AsyncIterator, Awaitable, Callable

from ..base.config import Config
from ..base.keys import is_key, messages_key
from ..modes.models import Router
from ..sessions.facade import Sessions
from ..shared import SharedError
from ..store.directory import StoreError
from . import doctor, protocol
from .protocol import Code, ProtocolError

log = logging.getLogger("autosessd")


class SocketInUse(Exception):
    pass


def peer_credentials(sock: socket.socket) -> tuple[int | None, int | None, int | None]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    if sys.platform.startswith("linux"):
        data = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, gid = struct.unpack("3i", data)
        return pid, uid, gid
    # macOS/BSD: LOCAL_PEERCRED gives a struct xucred {u_int version; uid_t uid; short ngroups; gid_t groups[16]}
    local_peercred = getattr(socket, "LOCAL_PEERCRED", 0x001)
    data = sock.getsockopt(0, local_peercred, struct.calcsize("IiH16I") + 8)
    _, uid, ngroups = struct.unpack_from("IiH", data)
    gid = struct.unpack_from("16I", data, struct.calcsize("IiH") + 2)[0] if ngroups else None
    return None, uid, gid


class ControlServer:
    name = "socket"

    def __init__(self, cfg: Config, sessions: Sessions | Router):
        """sessions: the engine's Sessions, or behind a llama-server router the Router (its
        per-model commands then name the model)."""
        self.cfg = cfg
        self.sessions = sessions
        self.router = sessions if isinstance(sessions, Router) else None
        self.path = cfg.effective_socket()
        self.gid = grp.getgrnam(cfg.control.group).gr_gid if cfg.control.group else None
        self.server: asyncio.AbstractServer | None = None
        self.connections = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self.handlers: dict[str, Callable[[dict[str, Any]], Awaitable[Any]]] = {
            "status": self.cmd_status,
            "ls": self.cmd_ls,
            "park": self.cmd_park,
            "restore": self.cmd_restore,
            "prune": self.cmd_prune,
            "forget": self.cmd_forget,
            "turn": self.cmd_turn,
            "doctor": self.cmd_doctor,
        }

    # -- life ------------------------------------------------------------------
    async def start(self) -> None:
        parent = self.path.parent
        mode = 0o750 if self.gid is not None else 0o700
        if not parent.exists():
            parent.mkdir(parents=True, mode=mode)
            if self.gid is not None:
                os.chown(parent, -1, self.gid)
        self._clear_stale()
        old = os.umask(0o117 if self.gid is not None else 0o177)
        try:
            self.server = await asyncio.start_unix_server(self.serve, str(self.path), limit=protocol.MAX_REQUEST + 1,
                                                          backlog=1024)
        finally:
            os.umask(old)
        if self.gid is not None:
            os.chown(self.path, -1, self.gid)
        log.info("control socket: %s (mode %o)", self.path, stat.S_IMODE(os.stat(self.path).st_mode))

    def _clear_stale(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise SocketInUse(f"{self.path} exists and is not a socket: remove it or choose another control.socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(str(self.path))
        except OSError as e:
            if e.errno in (errno.ECONNREFUSED, errno.ENOENT):
                log.info("control socket: removing the stale %s (nobody answers)", self.path)
                self.path.unlink(missing_ok=True)
                return
            raise SocketInUse(f"cannot check {self.path}: {e.strerror}") from None
        finally:
            probe.close()
        raise SocketInUse(f"another autosessd is running on {self.path}: stop it, or give this one another "
                          f"--socket")

    async def stop(self, grace_s: float) -> None:
        if self.server is not None:
            self.server.close()
            for w in list(self._writers):
                w.close()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.server.wait_closed(), min(grace_s, 5.0))
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def describe(self) -> dict[str, Any]:
        return {"path": str(self.path), "group": self.cfg.control.group}

    # -- connections -------------------------------------------------------------
    def allowed(self, uid: int | None, gid: int | None) -> bool:
        if uid is None:
            return False
        if uid == 0 or uid == os.getuid():
            return True
        if self.gid is None:
            return False
        if gid == self.gid:
            return True
        try:
            name = pwd.getpwuid(uid).pw_name
            return self.gid in os.getgrouplist(name, gid if gid is not None else self.gid)
        except KeyError:
            return False

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        self.connections += 1
        try:
            sock = writer.get_extra_info("socket")
            try:
                _, uid, gid = peer_credentials(sock)
            except OSError:
                uid = gid = None
            allowed = self.allowed(uid, gid)
            if not allowed:
                log.warning("control socket: refused a peer with uid %s gid %s", uid, gid)
            while True:
                try:
                    line = await asyncio.wait_for(reader.readline(), protocol.IDLE_TIMEOUT_S)
                except asyncio.TimeoutError:
                    await self._send(writer, protocol.err(Code.TIMEOUT, f"idle for {protocol.IDLE_TIMEOUT_S:g} s"))
                    return
                except (ValueError, asyncio.LimitOverrunError):
                    await self._send(writer, protocol.err(Code.TOO_LARGE,
                                                          f"request over {protocol.MAX_REQUEST} bytes"))
                    return
                if not line:
                    return
                if not line.endswith(b"\n"):
                    return  # hung up mid-line: nothing to answer
                if not line.strip():
                    continue
                # Refusals are answered after reading the request, so the client sees them.
                if not allowed:
                    await self._send(writer, protocol.err(Code.FORBIDDEN, f"uid {uid} may not use this socket"))
                    return
                if self.connections > protocol.MAX_CONNECTIONS:
                    await self._send(writer, protocol.err(Code.BUSY, "too many connections; try again"))
                    return
                if not await self.handle_line(line, reader, writer):
                    return
        except (ConnectionError, BrokenPipeError):
            pass  # the client went away mid-answer; nobody to tell
        finally:
            self.connections -= 1
            self._writers.discard(writer)
            writer.close()

    async def _send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        await writer.drain()

    async def handle_line(self, line: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Answer one request. Returns False when the connection is done."""
        try:
            req = protocol.parse_request(line)
        except ProtocolError as e:
            await self._send(writer, protocol.err(e.code, e.message))
            return True
        if req.cmd == "events":
            await self.cmd_events(req.args, reader, writer)
            return False
        try:
            result = await self.handlers[req.cmd](req.args)
        except ProtocolError as e:
            await self._send(writer, protocol.err(e.code, e.message))
            return True
        except StoreError as e:
            await self._send(writer, protocol.err(Code.FAILED, str(e)))
            return True
        except Exception as e:
            log.exception("control socket: %s: %s", req.cmd, e)
            await self._send(writer, protocol.err(Code.INTERNAL, f"{req.cmd}: {type(e).__name__}: {e}"))
            return True
        await self._send(writer, protocol.ok(result))
        return True

    # -- commands ----------------------------------------------------------------
    async def cmd_status(self, args: dict[str, Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, self.sessions.status)

    async def cmd_doctor(self, args: dict[str, Any]) -> Any:
        return await doctor.run(self.sessions)

    async def cmd_ls(self, args: dict[str, Any]) -> Any:
        if self.router is not None:
            return await self.router.ls_words(args.get("model"))
        return await self.sessions.ls_words()

    async def cmd_park(self, args: dict[str, Any]) -> Any:
        async with self._target("park", args, load=False) as s:
            return await s.park(self._slot_arg("park", args, s), args.get("name"))

    async def cmd_restore(self, args: dict[str, Any]) -> Any:
        async with self._target("restore", args) as s:
            return await s.restore_now(args["what"], self._slot_arg("restore", args, s))

    @contextlib.asynccontextmanager
    async def _target(self, cmd: str, args: dict[str, Any], load: bool = True) -> AsyncIterator[Sessions]:
        """The Sessions a command about a slot acts on: the engine's; behind a router the one
        of the model it names, loaded for it (blocks on the model switch; with load=False, only
        a loaded one: a park has nothing to save in a model that is not) and counted in use."""
        if self.router is None:
            yield self.sessions  # type: ignore[misc]
            return
        model = args.get("model")
        names = ", ".join(sorted(self.router.models)) or "none"
        if not model:
            raise ProtocolError(Code.BAD_ARGS, f"{cmd}: the engine is a router: name the model (--model; it serves "
                                               f"{names})")
        s = await self.router.acquire(model, load)
        if s is None and not load and model in self.router.models:
            raise ProtocolError(Code.NOT_FOUND, f"{cmd}: model {model!r} is not loaded: its slots hold nothing")
        if s is None:
            raise ProtocolError(Code.NOT_FOUND, f"{cmd}: the router has no model {model!r} whose conversations "
                                                f"autosessd keeps, or it did not load (it serves {names})")
        try:
            yield s
        finally:
            self.router.release(model)

    async def cmd_prune(self, args: dict[str, Any]) -> Any:
        keep, max_gb = args.get("keep"), args.get("max_gb")
        if keep is not None and keep < 0:
            raise ProtocolError(Code.BAD_ARGS, f"prune: keep must be 0 or more, got {keep}")
        if max_gb is not None and max_gb < 0:
            raise ProtocolError(Code.BAD_ARGS, f"prune: max_gb must be 0 or more, got {max_gb}")
        if args.get("shared"):
            remote = self.sessions.remote
            if remote is None:
                raise ProtocolError(Code.FAILED, "prune --shared: this daemon has no shared bucket (no [shared] "
                                                 "table in its config)")
            try:
                return {"shared": True, **await remote.prune(bool(args.get("dry_run")), keep, max_gb)}
            except SharedError as e:
                raise ProtocolError(Code.FAILED, str(e)) from None
        return await self.sessions.prune(keep, max_gb, bool(args.get("dry_run")))

    async def cmd_forget(self, args: dict[str, Any]) -> Any:
        key = args["key"]
        if not is_key(key):
            raise ProtocolError(Code.BAD_ARGS, f"forget: {key[:64]!r} is not a conversation key (16 hex digits)")
        done = await self.sessions.forget(key)
        if not (done["files"] or done["emptied_slots"] or done["running_slots"] or done["kept"]
                or done["erase_failed"]):
            raise ProtocolError(Code.NOT_FOUND, f"no conversation {key}: no file of it, and no slot holds it")
        return done

    async def cmd_turn(self, args: dict[str, Any]) -> Any:
        if "key" in args:
            key = args["key"]
            if not is_key(key):
                raise ProtocolError(Code.BAD_ARGS, f"turn: {key[:64]!r} is not a conversation key (16 hex digits)")
        elif "messages" in args:
            key = messages_key(args["messages"])
        else:
            raise ProtocolError(Code.BAD_ARGS, "turn: give \"key\" or \"messages\"")
        async with self._target("turn", args) as s:
            if self.router is not None:
                key = self.router.key(args["model"], key)  # a model's files are its own
            slot = self._slot_arg("turn", args, s)
            # The serving layer runs the request after our answer and does not report its end:
            # the next turn finds it ended (sessions: SWITCHED, end not seen). Without a slot,
            # autosessd places the conversation; the answer's "slot" is where to pin the request.
            ticket = await (s.admit(slot) if slot is not None else s.place(key))
            async with ticket:
                # The messages are the request's chat body as far as the hook knows it: its tokens
                # choose what to restore (a serving layer's tools or template options are not sent).
                body = {"messages": args["messages"]} if "messages" in args else None
                result = await s.turn(ticket, key, sees_end=False, body=body)
        return result.to_dict()

    @staticmethod
    def _slot_arg(cmd: str, args: dict[str, Any], s: Sessions) -> int | None:
        slot = args.get("slot")
        if slot is not None and slot not in s.slots:
            raise ProtocolError(Code.BAD_ARGS, f"{cmd}: the engine has no slot {slot} (it has "
                                               f"{', '.join(map(str, sorted(s.slots)))})")
        return slot

    @staticmethod
    async def _until_eof(reader: asyncio.StreamReader) -> None:
        while await reader.read(4096):
            pass

    async def cmd_events(self, args: dict[str, Any], reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        limit = args.get("limit", 100)
        recent = list(self.sessions.events.recent)[-limit:] if limit > 0 else []
        if not args.get("follow"):
            await self._send(writer, protocol.ok(recent))
            return
        with self.sessions.events.follow() as q:
            await self._send(writer, protocol.ok({"following": True, "recent": recent}))
            # A follower only listens; its hanging up (EOF) ends the follow at once. What it
            # sends meanwhile is read in small pieces and dropped, never kept.
            hangup = asyncio.ensure_future(self._until_eof(reader))
            try:
                while True:
                    get = asyncio.ensure_future(q.get())
                    done, _ = await asyncio.wait({get, hangup}, return_when=asyncio.FIRST_COMPLETED)
                    if hangup in done:
                        get.cancel()
                        return
                    ev = get.result()
                    if ev is None:
                        await self._send(writer, protocol.err(Code.OVERFLOW, "fell behind; follow again"))
                        return
                    await self._send(writer, protocol.encode({"event": ev}))
            finally:
                hangup.cancel()
