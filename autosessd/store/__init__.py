"""The session directory on disk (DESIGN §4): what its files are called and what an auto file's
metadata says (names.py), what a slot file says of itself, its token list read from its header
(slotfile.py), the directory itself: the atomic finalize that writes a save to disk, the
scan, the budget and prune (directory.py), the token index over the files (index.py), and the
names of diverging conversations and shared prefixes by their tokens (branches.py). It knows
nothing of the engine, the slots or the turn: the sessions decide, the store writes what it is
told, never a torn `auto-*.bin`. May import: base."""
