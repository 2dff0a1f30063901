"""A stand-in llama-server binary for tests of scripts/engine_build.py (fetch-engine's checks).

    python tests/fake_llama_server.py MODE <llama-server arguments ...>

Modes, each a way a real build behaves on some machine:
    answer             loads, answers /health and /completion like llama-server
    sigill-load        dies with SIGILL before it listens (AMX kernels at model load warm-up)
    sigill-completion  listens, then dies with SIGILL at the first /completion
    sigill-mid-answer  the same, after it has sent the answer's headers
    hang               never finishes loading: /health answers 503 forever
    exit               exits with status 1 before it listens (e.g. a bad model path)

It differs from llama-server in everything else: it reads no model and knows no other endpoint.
Use `executable(tmp_path, mode)` to get a file that can stand where the binary goes.
"""

from __future__ import annotations

import json
import os
import resource
import shlex
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def executable(directory: Path, mode: str, name: str = "llama-server") -> Path:
    """An executable file that runs this fake in `mode` with whatever arguments it is given."""
    path = directory / name
    path.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(__file__)} {mode} \"$@\"\n")
    path.chmod(0o755)
    return path


def die_by_sigill() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file in the test's directory
    os.kill(os.getpid(), signal.SIGILL)
    threading.Event().wait()  # from a thread, the signal lands a moment later: send nothing meanwhile


def main() -> None:
    mode, args = sys.argv[1], sys.argv[2:]
    if os.environ.get("FAKE_LLAMA_PID_FILE"):  # lets a test see that the checker stopped it
        Path(os.environ["FAKE_LLAMA_PID_FILE"]).write_text(str(os.getpid()))
    if mode == "sigill-load":
        die_by_sigill()
    if mode == "exit":
        print("error: failed to load model", file=sys.stderr)
        sys.exit(1)
    port = int(args[args.index("--port") + 1])

    class Handler(BaseHTTPRequestHandler):
        def reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if mode == "hang":
                self.reply(503, {"error": {"message": "Loading model"}})
            else:
                self.reply(200, {"status": "ok"})

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if mode == "sigill-completion":
                die_by_sigill()
            if mode == "sigill-mid-answer":
                self.send_response(200)
                self.send_header("Content-Length", "100")
                self.end_headers()
                self.wfile.flush()
                die_by_sigill()
            self.reply(200, {"content": " Paris", "timings": {"prompt_n": 6}})

        def log_message(self, *a):
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
