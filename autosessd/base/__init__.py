"""What every layer may use, and which imports nothing of autosessd's: the config (one frozen
Config from TOML and flags, config.py), the conversation key (DESIGN §1, keys.py), reading
files autosessd does not control and the digest that says a session file is whole (files.py),
and the daemon's log (logs.py). May import: nothing above it."""
