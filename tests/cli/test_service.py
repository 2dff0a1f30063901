"""Service files: systemd units verify, launchd agents parse and carry the keys that matter;
and the daemon's side of the systemd protocol (sd_notify). The units run as written:
test_service_as_written.py."""

import os
import plistlib
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from harness import ROOT, Daemon, FakeEngine, engine_paths

UNITS = ROOT / "systemd"
AGENTS = ROOT / "launchd"


def systemd_analyze_or_skip() -> str:
    """systemd-analyze (Debian's systemd package: `make test` installs it as root, scripts/systemd-tool).
    Missing: the test skips and says why, or fails where AUTOSESSD_REQUIRE_SYSTEMD is set (.ci/run)."""
    path = shutil.which("systemd-analyze")
    if path is None:
        why = ("systemd-analyze is not installed here (Debian/Ubuntu: sudo apt-get install -y systemd, or "
               "make systemd-packages as root)")
        if os.environ.get("AUTOSESSD_REQUIRE_SYSTEMD"):
            pytest.fail(f"AUTOSESSD_REQUIRE_SYSTEMD is set: {why}")
        pytest.skip(reason=why)
    return path


def test_systemd_units_verify(tmp_path):
    systemd_analyze_or_skip()
    # verify checks that ExecStart binaries exist: point them at the ones this checkout has.
    autosessd = shutil.which("autosessd") or str(ROOT / ".venv" / "bin" / "autosessd")
    server = engine_paths()["LLAMA_SERVER"]
    units = ("autosessd.service", "llama-server.service", "autosessd-exec.service")
    for unit in units:
        text = (UNITS / unit).read_text().replace("/usr/local/bin/autosessd", autosessd)
        (tmp_path / unit).write_text(text.replace("/usr/local/bin/llama-server", server))
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", *units], cwd=tmp_path, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == ""


def test_autosessd_unit_has_what_the_daemon_relies_on():
    text = (UNITS / "autosessd.service").read_text()
    for line in ("Type=notify", "After=llama-server.service", "BindsTo=llama-server.service",
                 "StateDirectory=autosessd llm-sessions", "RuntimeDirectory=autosessd", "PrivateDevices=yes",
                 "NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes",
                 "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6", "TimeoutStopSec=15min", "WatchdogSec=",
                 "ExecReload=/bin/kill -HUP $MAINPID"):
        assert line in text, line
    engine = (UNITS / "llama-server.service").read_text()
    # Staging on tmpfs, shared with the engine, made at its start (a name of the service's own:
    # not the quick starts' /dev/shm/llm-sessions, which a user may have made).
    assert "--slot-save-path /dev/shm/llm-service-sessions" in engine and "-np 1" in engine
    assert "ExecStartPre=/bin/sh -c 'install -d -m 700 /dev/shm/llm-service-sessions && test -O /dev/shm/llm-service-sessions" in engine
    # Both write files that hold conversations.
    assert "UMask=0077" in text and "UMask=0077" in (UNITS / "llama-server.service").read_text()


def unit_lines(name: str) -> list[str]:
    """A unit's settings, continuation lines joined."""
    return (UNITS / name).read_text().replace("\\\n", " ").splitlines()


def test_the_pair_stops_autosessd_first_so_its_stop_save_finds_the_engine_up():
    """systemd stops units in the reverse of their start order: autosessd, ordered After= the
    engine and bound to it, is stopped first (also when only the engine is stopped or
    restarted: BindsTo puts autosessd's stop in the same job), and the engine's stop waits
    for autosessd's to finish. Nothing in the engine's unit may order it after autosessd."""
    ours = unit_lines("autosessd.service")
    assert "After=llama-server.service" in ours and "BindsTo=llama-server.service" in ours
    engine = unit_lines("llama-server.service")
    assert not [line for line in engine if "autosessd" in line and not line.startswith("#")]
    # The stop save's deadline lies inside the stop systemd allows (and autosessd asks for more).
    from autosessd.base.config import Config

    assert "TimeoutStopSec=15min" in ours and Config().stop_timeout_s < 15 * 60


def test_the_exec_unit_signals_autosessd_alone_at_a_stop():
    """With the engine as autosessd's child in one unit, systemd's default KillMode would
    SIGTERM the engine together with autosessd: the stop save would find it gone."""
    lines = unit_lines("autosessd-exec.service")
    assert "KillMode=mixed" in lines and "Type=notify" in lines and "NotifyAccess=main" in lines
    [start] = [line for line in lines if line.startswith("ExecStart=")]
    words = start.split()
    command = words[words.index("--") + 1:]
    assert words[1] == "run" and "--exec" in words and command[0] == "/usr/local/bin/llama-server"
    assert "--port" in command and "--slot-save-path" in command and "-np" in command
    # Staging on tmpfs (autosessd makes it), the store (the configuration's store_path) a StateDirectory.
    assert "--slot-save-path /dev/shm/llm-service-sessions" in start
    assert "StateDirectory=autosessd llm-sessions llm-models" in lines


def test_the_engine_unit_writes_the_log_autosessd_is_told_to_follow():
    """The engine log way in (issue 21): llama-server writes its own log where its unit may
    (LogsDirectory), and autosessd's unit, ordered after it, names that path for [engine] log."""
    import re

    from autosessd.base.config import parse

    engine_unit = (UNITS / "llama-server.service").read_text()
    path = re.search(r"--log-file (\S+)", engine_unit).group(1)
    assert path.startswith("/var/log/llama-server/") and "LogsDirectory=llama-server" in engine_unit
    assert "--slot-save-path /dev/shm/llm-service-sessions" in engine_unit
    ours = (UNITS / "autosessd.service").read_text()
    assert f'[engine] log = "{path}"' in ours
    assert "After=llama-server.service" in ours and "WantedBy=multi-user.target llama-server.service" in ours
    assert parse(f'slot_save_path = "/dev/shm/llm-sessions"\n[engine]\nlog = "{path}"\n'.encode()).engine.log == path
    with open(AGENTS / "org.autosessd.llama-server.plist", "rb") as f:
        args = plistlib.load(f)["ProgramArguments"]
    agent_log = args[args.index("--log-file") + 1]
    assert f'[engine] log = "{agent_log}"' in (AGENTS / "org.autosessd.autosessd.plist").read_text()


@pytest.mark.parametrize("name", ["org.autosessd.autosessd.plist", "org.autosessd.llama-server.plist"])
def test_launchd_agents_parse(name):
    with open(AGENTS / name, "rb") as f:
        p = plistlib.load(f)
    assert p["Label"] == name.removesuffix(".plist")
    assert p["ProgramArguments"][0].startswith("/")
    assert p["KeepAlive"] and p["RunAtLoad"] is True
    assert p["StandardErrorPath"].endswith(".log") and p["StandardOutPath"].endswith(".log")
    assert p["ExitTimeOut"] >= (600 if "autosessd.autosessd" in name else 10)
    if "autosessd.autosessd" in name:
        assert p["ProgramArguments"][1] == "run"


def test_sd_notify_ready_status_stopping(tmp_path, session_dir):
    """The daemon under a fake systemd: READY=1 after the engine check, STOPPING=1 and an
    EXTEND_TIMEOUT_USEC at the stop, WATCHDOG=1 while WATCHDOG_USEC is set."""
    eng = FakeEngine(session_dir).start()
    sock_path = str(tmp_path / "notify.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(sock_path)
    s.settimeout(30)
    d = Daemon(tmp_path, session_dir, eng.url, gate=False)
    env = {**os.environ, "NOTIFY_SOCKET": sock_path, "WATCHDOG_USEC": "200000"}
    p = subprocess.Popen([sys.executable, "-m", "autosessd", "run", "--config", str(d.config)], env=env,
                         stderr=subprocess.DEVNULL)
    try:
        got = []
        while not any("READY=1" in m for m in got):
            got.append(s.recv(4096).decode())
        while not any("WATCHDOG=1" in m for m in got):
            got.append(s.recv(4096).decode())
        p.send_signal(signal.SIGTERM)
        while not any("EXTEND_TIMEOUT_USEC=" in m for m in got):
            got.append(s.recv(4096).decode())
        assert p.wait(30) == 0
        assert any("STOPPING=1" in m for m in got)
    finally:
        p.kill()
        eng.stop()
        s.close()


def test_sighup_reloads_and_keeps_the_old_config_when_the_new_one_is_bad(tmp_path, session_dir):
    import json

    from harness import wait_until

    eng = FakeEngine(session_dir).start()
    d = Daemon(tmp_path, session_dir, eng.url, gate=True, min_tokens=100).start()
    try:
        assert d.status()["store"]["min_tokens"] == 100
        d.config.write_text(d.config.read_text().replace("auto_sessions_min_tokens = 100",
                                                         "auto_sessions_min_tokens = 7\nidle_save_s = 9"))
        d.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: d.status()["store"]["min_tokens"] == 7, 10, what="the reload")
        assert d.status()["idle_save"]["after_s"] == 9  # saving while idle is policy too
        good = d.config.read_text()
        d.config.write_text(good + "\nbogus_key = 1\n")
        d.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "reload refused" in d.logtext(), 10, what="the refusal")
        assert "bogus_key" in d.logtext() and d.status()["store"]["min_tokens"] == 7
        assert json.loads(json.dumps(d.status()))["engine"]["healthy"] is True
    finally:
        d.stop()
        eng.stop()



@pytest.mark.parametrize("unit", ["autosessd.service", "autosessd-exec.service"])
def test_the_start_outlasts_the_engines_model_load(unit):
    """autosessd says READY only once the engine has loaded its model (engine.timeout_s, 120 s by
    default); systemd's own default start timeout is 90 s, after which it would kill autosessd
    mid-wait, and again at each restart, for a model that loads slower than that."""
    from autosessd.base.config import Config

    line = next((x for x in unit_lines(unit) if x.startswith("TimeoutStartSec=")), None)
    assert line is not None, f"{unit} leaves the start to systemd's default 90 s"
    value = line.split("=", 1)[1]
    assert value == "infinity" or (value.endswith("min") and int(value[:-3]) * 60 > Config().engine.timeout_s)
