"""The doors: the HTTP gate in front of the engine that runs the turn before a conversation's
request (gate.py) and its front door rules: who, how many, how slowly (guard.py); the control
socket (control.py) and its protocol, shared with autosessctl (protocol.py); and what the
socket's `doctor` answers (doctor.py). May import: follow, modes, sessions and below."""
