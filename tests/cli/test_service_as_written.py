"""The systemd units as written (docs/service.md): their ExecStart lines run with the
configuration the page gives, and autosessctl reaches the service's socket as the page says.

What the tests change in a unit's command line is only what this machine must: the paths under
/etc, /run and /var go under a temporary directory, those under /dev/shm under one in /dev/shm, the programs are this checkout's autosessd
and the engine tests/ builds, the model is the test model, the ports free ones. Everything else
(every flag, the configuration docs/service.md has people write) is as written."""

import grp
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import pytest

from harness import ROOT, engine_paths, free_port, wait_until

UNITS = ROOT / "systemd"
SERVICE_PAGE = ROOT / "docs" / "service.md"


def unit_lines(name: str) -> list[str]:
    """A unit's settings, continuation lines joined."""
    return (UNITS / name).read_text().replace("\\\n", " ").splitlines()


def exec_start(unit: str, key: str = "ExecStart") -> list[str]:
    """The unit's ExecStart= (or ExecStartPre=) command line, split as systemd splits it
    (shell-like quoting)."""
    [line] = [x for x in unit_lines(unit) if x.startswith(key + "=")]
    return shlex.split(line.removeprefix(key + "="))


def documented_config() -> str:
    """The configuration docs/service.md has people write to /etc/autosessd/autosessd.toml (its first)."""
    m = re.search(r"sudo tee /etc/autosessd/autosessd\.toml >/dev/null <<'EOF'\n(.*?)\nEOF\n", SERVICE_PAGE.read_text(),
                  re.S)
    assert m, "docs/service.md no longer writes /etc/autosessd/autosessd.toml with a here-document"
    return m.group(1)


class Machine:
    """A temporary root standing in for /: the directories systemd makes for a unit, and the
    unit's command line with its paths moved under it. World-traversable (unlike pytest's tmp),
    so a process of another user can reach the socket, as on a real machine."""

    def __init__(self, group: grp.struct_group):
        self.root = Path(tempfile.mkdtemp(prefix="autosessd-unit-"))
        os.chmod(self.root, 0o755)
        self.shm = Path(tempfile.mkdtemp(prefix="autosessd-unit-", dir="/dev/shm"))  # tmpfs, as /dev/shm is
        self.group = group  # the unit's Group= (llm on a real machine)
        bin_dir = Path(sys.executable).parent
        self.autosessd = [str(bin_dir / "autosessd")] if (bin_dir / "autosessd").exists() else \
            [sys.executable, "-m", "autosessd"]

    def path(self, absolute: str) -> Path:
        if absolute.startswith("/dev/shm/"):
            return self.shm / absolute.removeprefix("/dev/shm/")
        return self.root / absolute.lstrip("/")

    def directories(self, unit: str) -> None:
        """What systemd makes before it starts the unit: its StateDirectory= and LogsDirectory=
        (0755) and RuntimeDirectory= (RuntimeDirectoryMode=), owned by its User= (this process)
        and Group=."""
        lines = unit_lines(unit)

        def setting(key: str) -> list[str]:
            return [x.split("=", 1)[1] for x in lines if x.startswith(key + "=")]

        runtime_mode = int((setting("RuntimeDirectoryMode") or ["0755"])[0], 8)
        for key, base, mode in (("StateDirectory", "/var/lib", 0o755), ("LogsDirectory", "/var/log", 0o755),
                                ("RuntimeDirectory", "/run", runtime_mode)):
            for value in setting(key):
                for name in value.split():
                    d = self.path(f"{base}/{name}")
                    d.mkdir(parents=True, exist_ok=True)
                    os.chown(d, -1, self.group.gr_gid)
                    os.chmod(d, mode)

    def command(self, words: list[str], port: int) -> list[str]:
        programs = {"/usr/local/bin/autosessd": self.autosessd,
                    "/usr/local/bin/llama-server": [engine_paths()["LLAMA_SERVER"]]}
        out: list[str] = []
        for i, w in enumerate(words):
            if w in programs:
                out += programs[w]
            elif i and words[i - 1] == "--port":
                out.append(str(port))
            elif w.startswith(("/etc/", "/run/", "/var/", "/dev/shm/")):
                out.append(str(self.path(w)))
            elif i == 0 and w.startswith(("/usr/bin/", "/bin/")):  # a system program (ExecStartPre's sh)
                out.append(w)
            elif i and words[i - 1] == "-c":  # a shell's script: its /dev/shm paths moved too
                out.append(w.replace("/dev/shm/", f"{self.shm}/"))
            else:
                assert not w.startswith("/"), f"a path the test does not know how to place: {w}"
                out.append(w)
        return out

    def config(self, gate_port: int, extra: str = "") -> None:
        """docs/service.md's configuration at the unit's --config path, its paths under the root,
        its gate on a free port, its control.group the unit's Group=."""
        text = documented_config()
        for mine in ('slot_save_path = "/dev/shm/llm-service-sessions"', 'store_path = "/var/lib/llm-sessions"',
                     'listen = "127.0.0.1:8081"', 'group = "llm"'):
            assert mine in text, f"docs/service.md's configuration no longer has {mine}"
        text = (text.replace('"/var/lib/', f'"{self.root}/var/lib/').replace('"/dev/shm/', f'"{self.shm}/')
                .replace("127.0.0.1:8081", f"127.0.0.1:{gate_port}")
                .replace('group = "llm"', f'group = "{self.group.gr_name}"'))
        conf = self.path("/etc/autosessd/autosessd.toml")
        conf.parent.mkdir(parents=True, mode=0o755, exist_ok=True)
        conf.write_text(text + extra)

    def model(self, unit_words: list[str]) -> None:
        """The unit's -m path holds the test model."""
        m = self.path(unit_words[unit_words.index("-m") + 1])
        m.parent.mkdir(parents=True, exist_ok=True)
        m.symlink_to(engine_paths()["MODEL"])

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self.shm, ignore_errors=True)


def unit_group() -> grp.struct_group:
    """As root, a group of its own for the unit (nogroup), so that another uid's membership decides;
    else this user's own group."""
    if os.geteuid() == 0:
        try:
            return grp.getgrgid(65534)
        except KeyError:
            pass
    return grp.getgrgid(os.getgid())


def start_notify(argv: list[str], log: Path, root: Path, timeout: float = 180) -> subprocess.Popen:
    """Type=notify: started with NOTIFY_SOCKET, ready at READY=1 (as systemd waits for it)."""
    addr = str(root / "notify.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(addr)
    s.settimeout(1)
    with open(log, "ab") as err:
        p = subprocess.Popen(argv, env={**os.environ, "NOTIFY_SOCKET": addr}, stdout=subprocess.DEVNULL, stderr=err)
    try:
        got: list[str] = []

        def ready() -> bool:
            if p.poll() is not None:
                raise AssertionError(f"{argv[0]} exited with {p.returncode}:\n{log.read_text()}")
            try:
                got.append(s.recv(4096).decode())
            except socket.timeout:
                pass
            return any("READY=1" in m for m in got)

        wait_until(ready, timeout, 0, what="READY=1 from the unit's command")
    except BaseException:
        p.kill()
        raise
    finally:
        s.close()
    return p


def autosessctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from autosessd.cli import autosessctl_main; autosessctl_main()",
                           *args], capture_output=True, text=True, timeout=60)


def as_uid(uid: int, gid: int, call) -> str:
    """call() in a forked child running as uid:gid with no other group: "exit code: message"."""
    from autosessd import ctl

    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rd)
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            call()
            out = "0: ok"
        except ctl.CtlError as e:
            out = f"{e.exit_code}: {e}"
        except BaseException as e:  # noqa: BLE001 - report anything to the parent
            out = f"?: {e!r}"
        os.write(wr, out.encode())
        os._exit(0)
    os.close(wr)
    with os.fdopen(rd) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return out


@pytest.mark.engine
def test_the_pair_runs_as_written_and_autosessctl_finds_its_socket(monkeypatch):
    """llama-server.service's and autosessd.service's ExecStart lines, as written, with the
    configuration docs/service.md gives: autosessd is ready (READY=1), serves the page's check (a
    request through the gate says X-Autosessd-Slot), `autosessctl --socket /run/autosessd/…`
    answers, and so does a plain `autosessctl status` of a user who runs no autosessd of their
    own. As root also across users, as the page says: a member of control.group (the unit's
    Group=) gets the status, a stranger exit 4, told why."""
    m = Machine(unit_group())
    engine = daemon = None
    try:
        m.directories("llama-server.service")
        m.directories("autosessd.service")
        engine_port, gate_port = free_port(), free_port()
        subprocess.run(m.command(exec_start("llama-server.service", "ExecStartPre"), 0), check=True)  # staging
        engine_words = exec_start("llama-server.service")
        m.model(engine_words)
        engine = subprocess.Popen(m.command(engine_words, engine_port), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True)

        def engine_up() -> bool:
            assert engine.poll() is None, f"the engine unit's command exited with {engine.returncode}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{engine_port}/health", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_until(engine_up, 180, 0.2, "the engine unit's llama-server")
        m.config(gate_port, extra=f'\n[engine]\nurl = "http://127.0.0.1:{engine_port}"\n')  # the unit's :8080
        words = exec_start("autosessd.service")
        assert words[:3] == ["/usr/local/bin/autosessd", "run", "--config"]
        daemon = start_notify(m.command(words, 0), m.root / "autosessd.log", m.root)
        sock = m.path(words[words.index("--socket") + 1])
        assert sock.is_socket() and sock.parent == m.path("/run/autosessd")
        assert os.stat(sock).st_mode & 0o777 == 0o660 and os.stat(sock).st_gid == m.group.gr_gid

        # The page's check: a request through the gate, its answer's headers.
        req = urllib.request.Request(f"http://127.0.0.1:{gate_port}/v1/chat/completions",
                                     data=json.dumps({"messages": [{"role": "user", "content": "Hello"}],
                                                      "max_tokens": 8}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.headers["X-Autosessd-Slot"] == "0"
        r = autosessctl("--socket", str(sock), "status")
        assert r.returncode == 0 and "autosessd" in r.stdout, r.stderr
        # The pair as written gets the store's economy: the engine saves into staging on tmpfs,
        # the store is on the disk (autosessd says at start when the engine's files land on one).
        assert "on a disk" not in (m.root / "autosessd.log").read_text()
        assert m.path("/var/lib/llm-sessions").is_dir() and m.path("/dev/shm/llm-service-sessions").stat().st_mode & 0o777 == 0o700

        # A plain `autosessctl status`: no socket of the user's own, the system service's is found.
        from click.testing import CliRunner

        from autosessd import ctl

        monkeypatch.setattr(ctl, "SYSTEM_SOCKET", sock)
        monkeypatch.setenv("AUTOSESSD_CONFIG", str(m.path("/etc/autosessd/autosessd.toml")))  # the system's file
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(m.root / "user-runtime"))
        if os.geteuid() != 0:
            assert ctl.socket_path(None) == sock
            res = CliRunner().invoke(ctl.cli, ["status"])
            assert res.exit_code == 0 and "autosessd" in res.output, res.output
        else:
            member = as_uid(65533, m.group.gr_gid, lambda: ctl.call(ctl.socket_path(None), "status", timeout=10))
            assert member == "0: ok"
            stranger = as_uid(65534, 65533, lambda: ctl.call(ctl.socket_path(None), "status", timeout=10))
            assert stranger == (f"4: permission denied: {sock} (run as the daemon's user, root, or a member of "
                                f"control.group)")
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(60) == 0
    finally:
        if daemon is not None and daemon.poll() is None:
            daemon.kill()
        if engine is not None:
            engine.terminate()
            engine.wait(30)
        m.cleanup()


@pytest.mark.engine
def test_the_exec_unit_runs_as_written():
    """autosessd-exec.service's ExecStart, as written, with the same configuration: ready with
    the engine as its child, the gate on the command's --port, the socket where autosessctl looks;
    SIGTERM to autosessd alone (KillMode=mixed) stops both, exit 0."""
    import psutil

    m = Machine(unit_group())
    daemon = None
    try:
        m.directories("autosessd-exec.service")
        words = exec_start("autosessd-exec.service")
        m.model(words)
        port = free_port()
        m.config(free_port())  # its gate.listen: replaced by the command's --host/--port
        daemon = start_notify(m.command(words, port), m.root / "autosessd.log", m.root)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            assert r.status == 200
        sock = m.path(words[words.index("--socket") + 1])
        r = autosessctl("--socket", str(sock), "--json", "status")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["engine"]["healthy"] is True
        assert "on a disk" not in (m.root / "autosessd.log").read_text()  # staged on tmpfs, as the pair
        children = psutil.Process(daemon.pid).children(recursive=True)
        assert children, "no engine under autosessd"
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(60) == 0
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, f"the engine outlived autosessd's stop: {alive}"
        daemon = None
    finally:
        if daemon is not None:
            for c in psutil.Process(daemon.pid).children(recursive=True):
                c.kill()
            daemon.kill()
        m.cleanup()


def test_a_plain_autosessctl_looks_for_the_system_service_socket(tmp_path, monkeypatch):
    """autosessctl's socket: --socket, else control.socket, else the user's default path, and
    where nothing is there but /run/autosessd exists, the system service's socket."""
    from autosessd import ctl

    system = tmp_path / "run" / "autosessd" / "autosessd.sock"
    runtime = tmp_path / "user-runtime"
    conf = tmp_path / "autosessd.toml"
    conf.write_text("")
    monkeypatch.setattr(ctl, "SYSTEM_SOCKET", system)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # a user's view (root's default is the system socket)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.setenv("AUTOSESSD_CONFIG", str(conf))
    own = runtime / "autosessd" / "autosessd.sock"
    assert ctl.socket_path(None) == own  # no service either: the error names the user's path
    system.parent.mkdir(parents=True)
    assert ctl.socket_path(None) == system  # the service's runtime directory exists
    own.parent.mkdir(parents=True)
    own.touch()
    assert ctl.socket_path(None) == own  # the user's own daemon's socket comes first
    own.unlink()
    assert ctl.socket_path("/x/y.sock") == Path("/x/y.sock")
    conf.write_text('[control]\nsocket = "/elsewhere/a.sock"\n')
    assert ctl.socket_path(None) == Path("/elsewhere/a.sock")
