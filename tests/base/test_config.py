"""Config: defaults, TOML, flags over file, and errors that name the file, the key and why."""

import json
import os
import subprocess
import sys

import pytest

from autosessd.base import config
from autosessd.base.config import ConfigError, parse

BASE = b'slot_save_path = "/srv/sessions"\n'


def test_defaults_are_the_seeds():
    """The seed's defaults, but for min tokens: "auto" (issue 22; DESIGN §6's 16,000 was for a big
    model on a fast GPU, and left a CPU user's 3,000-token chat never saved)."""
    c = parse(BASE, "t.toml")
    assert (c.auto_sessions, c.auto_sessions_min_tokens, c.auto_sessions_keep, c.auto_sessions_max_gb) == \
        (True, "auto", 12, 100.0)
    assert c.engine.kind == "llama-server" and c.engine.slot == 0 and c.gate.listen is None
    assert c.gate.max_body_mb == 64  # chat with images fits


def test_full_file():
    c = parse(BASE + b"""
auto_sessions_min_tokens = 100
auto_sessions_max_gb = 2
[engine]
url = "http://127.0.0.1:9000"
api_key = "sekret"
timeout_s = 5
[gate]
listen = "127.0.0.1:8081"
request_log = "/var/log/gate.jsonl"
[tail]
request_log = "/var/log/other.jsonl"
[control]
socket = "/run/x.sock"
""", "t.toml")
    assert c.auto_sessions_min_tokens == 100 and c.auto_sessions_max_gb == 2.0
    assert c.engine.url == "http://127.0.0.1:9000" and c.engine.timeout_s == 5.0
    assert c.gate.listen == ("127.0.0.1:8081",) and c.control.socket == "/run/x.sock"
    assert c.masked()["engine"]["api_key"] == "***"


def test_gate_listen_takes_one_address_or_a_list():
    one = parse(BASE + b"[gate]\nlisten = '127.0.0.1:8081'\n")
    both = parse(BASE + b"[gate]\nlisten = ['127.0.0.1:8081', '[::1]:8081']\n")
    assert one.gate.listen == ("127.0.0.1:8081",) and both.gate.listen == ("127.0.0.1:8081", "[::1]:8081")
    assert parse(BASE, "t", {"gate.listen": "0.0.0.0:1"}).gate.listen == ("0.0.0.0:1",)  # --gate HOST:PORT


def test_flags_override_the_file():
    c = parse(BASE + b"auto_sessions_keep = 3\n[engine]\nurl = 'http://h:1'\n", "t.toml",
              {"auto_sessions_keep": 7, "engine.url": "http://127.0.0.1:2", "gate.listen": None})
    assert c.auto_sessions_keep == 7 and c.engine.url == "http://127.0.0.1:2"


@pytest.mark.parametrize(
    "text, key, reason",
    [
        (b"bogus = 1\n", "bogus", "unknown key"),
        (b"[engine]\nurll = 'x'\n", "engine.urll", "unknown key"),
        (b"auto_sessions_keep = -1\n", "auto_sessions_keep", "1 or more"),
        (b"auto_sessions_keep = '3'\n", "auto_sessions_keep", "whole number"),
        (b"auto_sessions_keep = true\n", "auto_sessions_keep", "whole number"),
        (b"auto_sessions = 1\n", "auto_sessions", "true or false"),
        (b"auto_sessions_max_gb = 0\n", "auto_sessions_max_gb", "more than 0"),
        (b"auto_sessions_min_tokens = -5\n", "auto_sessions_min_tokens", "0 or more"),
        (b"auto_sessions_min_tokens = 'Auto'\n", "auto_sessions_min_tokens", '"auto" or a whole number'),
        (b"auto_sessions_min_tokens = 1.5\n", "auto_sessions_min_tokens", '"auto" or a whole number'),
        (b"auto_sessions_min_tokens = true\n", "auto_sessions_min_tokens", '"auto" or a whole number'),
        (b"[engine]\nurl = 'ftp://x'\n", "engine.url", "http"),
        (b"[engine]\nurl = 'http://h:99999'\n", "engine.url", "port"),
        (b"[engine]\nkind = 'vllm'\n", "engine.kind", "one of"),
        (b"[engine]\nkind = 'control-stream'\n", "engine.control", "required"),
        (b"[engine]\ncontrol = 'udp:x'\n", "engine.control", "unix:/path"),
        (b"[engine]\ntimeout_s = 0\n", "engine.timeout_s", "more than 0"),
        (b"[gate]\nlisten = '8080'\n", "gate.listen", "HOST:PORT"),
        (b"[gate]\nlisten = ['127.0.0.1:1', '8080']\n", "gate.listen", "HOST:PORT"),
        (b"[gate]\nlisten = []\n", "gate.listen", "non-empty list"),
        (b"[gate]\nlisten = 8080\n", "gate.listen", "a string or a non-empty list"),
        (b"[gate]\nlisten = ['127.0.0.1:1', '127.0.0.1:1']\n", "gate.listen", "twice"),
        (b"[gate]\nmax_body_mb = 0\n", "gate.max_body_mb", "more than 0"),
        (b"[gate]\nconversation_id_headers = ['X-Conversation-Id', 'X Conv']\n", "gate.conversation_id_headers",
         "not a header name"),
        (b"[gate]\nconversation_id_headers = []\n", "gate.conversation_id_headers", "non-empty list"),
        (b"stop_timeout_s = -1\n", "stop_timeout_s", "more than 0"),
        (b"[gate]\nmax_body_mb = '64M'\n", "gate.max_body_mb", "must be a number"),
        (b"[control]\ngroup = 'no-such-group-xyz'\n", "control.group", "no such group"),
        (b"engine = 3\n", "engine", "table"),
        (b"[shared]\nbucket = 'sessions'\n", "shared.endpoint_url", "missing"),
        (b"[shared]\nendpoint_url = 'http://s3:7480'\n", "shared.bucket", "missing"),
        (b"[shared]\nendpoint_url = 's3.example.com'\nbucket = 'b01'\n", "shared.endpoint_url", "http"),
        (b"[shared]\nendpoint_url = 'http://k:s@s3'\nbucket = 'b01'\n", "shared.endpoint_url", "credentials"),
        (b"[shared]\nendpoint_url = 'http://s3'\nbucket = 'My_Bucket'\n", "shared.bucket", "bucket name"),
        (b"[shared]\nendpoint_url = 'http://s3'\nbucket = 'b01'\nprefix = '/abs/'\n", "shared.prefix", "folders"),
        (b"[shared]\nendpoint_url = 'http://s3'\nbucket = 'b01'\nprefix = 'no-slash'\n", "shared.prefix",
         "ending in '/'"),
        (b"[shared]\nendpoint_url = 'http://s3'\nbucket = 'b01'\nsecret_access_key = 'x'\n",
         "shared.secret_access_key", "never go in the config file"),
        (b"[shared]\nendpoint_url = 'http://s3'\nbucket = 'b01'\ncredentials_file = 'creds'\n",
         "shared.credentials_file", "absolute"),
        (b"[shared]\nendpoint_url = 'http://s3'\nbucket = 'b01'\nhost = 'a/b'\n", "shared.host", "letters"),
        (b"[shared]\nendpoint_url = 'http://s3'\nbucket = 'b01'\npart_mb = 4\n", "shared.part_mb", "5 to 5120"),
        (b"[shared]\nendpoint_url = 'http://s3'\nbucket = 'b01'\nread_timeout_s = 0\n", "shared.read_timeout_s",
         "more than 0"),
        (b"[shared]\nendpoint_url = 'http://s3'\nbucket = 'b01'\nkeep = 0\n", "shared.keep", "1 or more"),
        (b"[shared]\nendpoint_url = 'http://s3'\nbucket = 'b01'\nlease_s = 1\n", "shared.lease_s", "10 or more"),
        (b"[shared]\nendpoint_url = 'http://s3'\nbucket = 'b01'\nbogus = 1\n", "shared.bogus", "unknown key"),
        (b"[shared]\nendpoint_url = 'http://s3'\nbucket = 'b01'\ndownload_timeout_s = 0\n",
         "shared.download_timeout_s", "more than 0"),
        (b"[shared]\nendpoint_url = 'http://s3'\nbucket = 'b01'\nlist_every_s = 0\n", "shared.list_every_s",
         "0.5 or more"),
        (b"[shared]\nendpoint_url = 'http://s3'\nbucket = 'b01'\nprune_every_s = 5\n", "shared.prune_every_s",
         "10 or more"),
    ],
)
def test_bad_values_name_the_key(text, key, reason):
    with pytest.raises(ConfigError) as e:
        parse(BASE + text, "/etc/autosessd/autosessd.toml")
    assert e.value.key == key
    assert reason in e.value.reason
    assert str(e.value).startswith(f"/etc/autosessd/autosessd.toml: {key}: ")


def test_shared_absent_means_no_remote_tier_and_present_means_its_values():
    assert parse(BASE, "t.toml").shared is None
    c = parse(BASE + b"[shared]\nendpoint_url = 'https://s3.example.com'\nbucket = 'team-sessions'\n"
                     b"prefix = 'llm/prod/'\nkeep = 50\nmax_gb = 20\n", "t.toml")
    assert (c.shared.endpoint_url, c.shared.bucket, c.shared.prefix) == ("https://s3.example.com", "team-sessions",
                                                                         "llm/prod/")
    assert (c.shared.keep, c.shared.max_gb, c.shared.region) == (50, 20.0, "us-east-1")
    assert (c.shared.download_timeout_s, c.shared.list_every_s, c.shared.prune_every_s) == (120.0, 5.0, 600.0)
    assert parse(BASE + b"[shared]\nendpoint_url = 'http://s3'\nbucket = 'b01'\nprune_every_s = 0\n"
                 ).shared.prune_every_s == 0
    assert parse(BASE + b"[shared]\nendpoint_url = 'http://s3'\nbucket = 'b01'\nprefix = ''\n").shared.prefix == ""


def test_missing_and_relative_slot_save_path():
    with pytest.raises(ConfigError, match="slot_save_path: missing"):
        parse(b"", "t.toml")
    with pytest.raises(ConfigError, match="absolute"):
        parse(b'slot_save_path = "sessions"', "t.toml")


def test_bad_toml_and_bad_bytes():
    with pytest.raises(ConfigError, match="t.toml: not valid TOML"):
        parse(b"a = = 1", "t.toml")
    with pytest.raises(ConfigError, match="not UTF-8"):
        parse(b"\xff\xfe", "t.toml")


def test_search_order(tmp_path, monkeypatch):
    xdg = tmp_path / "xdg"
    (xdg / "autosessd").mkdir(parents=True)
    (xdg / "autosessd" / "autosessd.toml").write_text('slot_save_path = "/from/xdg"\n')
    env = tmp_path / "env.toml"
    env.write_text('slot_save_path = "/from/env"\n')
    flag = tmp_path / "flag.toml"
    flag.write_text('slot_save_path = "/from/flag"\n')
    monkeypatch.setenv("XDG_CONFIG_HOME", str(xdg))
    monkeypatch.delenv("AUTOSESSD_CONFIG", raising=False)
    assert config.load().slot_save_path == "/from/xdg"
    monkeypatch.setenv("AUTOSESSD_CONFIG", str(env))
    assert config.load().slot_save_path == "/from/env"
    assert config.load(str(flag)).slot_save_path == "/from/flag"
    with pytest.raises(ConfigError, match="no such file"):
        config.load(str(tmp_path / "missing.toml"))


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "autosessd", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=60)


def test_check_config_unknown_key_exits_2(tmp_path):
    f = tmp_path / "a.toml"
    f.write_text('slot_save_path = "/x"\n[engine]\nspeed = 3\n')
    r = _cli("check-config", "--config", str(f))
    assert r.returncode == 2
    assert str(f) in r.stderr and "engine.speed" in r.stderr and "unknown key" in r.stderr


def test_check_config_prints_effective_config_masked(tmp_path):
    f = tmp_path / "a.toml"
    f.write_text('slot_save_path = "/x"\n[engine]\napi_key = "sekret"\n')
    r = _cli("check-config", "--config", str(f))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["engine"]["api_key"] == "***" and "sekret" not in r.stdout
    assert out["auto_sessions_keep"] == 12


@pytest.mark.parametrize("text, want", [(b'auto_sessions_min_tokens = "auto"\n', "auto"),
                                        (b"auto_sessions_min_tokens = 0\n", 0),
                                        (b"auto_sessions_min_tokens = 3000\n", 3000), (b"", "auto")])
def test_min_tokens_auto_or_a_number(text, want):
    assert parse(BASE + text, "t.toml").auto_sessions_min_tokens == want


@pytest.mark.parametrize("flag, want", [("auto", "auto"), ("2500", 2500)])
def test_min_tokens_flag_overrides_the_file(flag, want):
    """`autosessd run --min-tokens auto|N` over a file's number or "auto"."""
    c = parse(BASE + b"auto_sessions_min_tokens = 100\n", "t.toml", {"auto_sessions_min_tokens": flag})
    assert c.auto_sessions_min_tokens == want
    with pytest.raises(ConfigError, match='auto_sessions_min_tokens: must be "auto"'):
        parse(BASE, "t.toml", {"auto_sessions_min_tokens": "lots"})
