"""`autosessd run`'s flags reach the config it runs with (issue 49: store_path had no flag, so the
quick start's tmpfs staging needed a config file)."""

from click.testing import CliRunner

from autosessd import cli, daemon


def test_store_path_has_a_flag(tmp_path, monkeypatch):
    seen = {}

    def run(cfg, config_path, overrides, child):
        seen["cfg"] = cfg
        return 0

    monkeypatch.setattr(daemon, "run", run)
    monkeypatch.setattr(cli, "exit_after_stop", lambda code: None)
    (tmp_path / "empty.toml").touch()
    res = CliRunner().invoke(cli.autosessd_main, [
        "run", "--config", str(tmp_path / "empty.toml"), "--engine-url", "http://127.0.0.1:9",
        "--slot-save-path", str(tmp_path / "staging"), "--store-path", str(tmp_path / "store")])
    assert res.exit_code == 0, res.output
    cfg = seen["cfg"]
    assert cfg.slot_save_path == str(tmp_path / "staging") and cfg.store_path == str(tmp_path / "store")
