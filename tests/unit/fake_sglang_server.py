"""A stand-in SGLang server process for the engine-death tests: /generate, /health_generate and
/abort_request in SGLang 0.5.x's shapes, nothing else, no sglang needed.

`python fake_sglang_server.py PORT_FILE GENERATE_S` serves on 127.0.0.1 (the port goes to
PORT_FILE once it listens) and answers each /generate after GENERATE_S seconds with one token
per row, or at once with finish reason "abort" after an /abort_request. The tests kill it
(SIGKILL: a crashed server) or stop it (SIGSTOP: a wedged one, or its node gone) mid-generate.
"""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def main(port_file: str, generate_s: float) -> None:
    aborted = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, status: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._answer(200 if self.path == "/health_generate" else 404, {})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if self.path == "/abort_request":
                aborted.set()
                self._answer(200, {})
            elif self.path == "/generate":
                reason = "abort" if aborted.wait(generate_s) else "length"
                row = {"output_ids": [7], "meta_info": {"finish_reason": {"type": reason},
                                                        "output_token_logprobs": [[-1.0, 7, None]]}}
                self._answer(200, [row] * len(body["input_ids"]))
            else:
                self._answer(404, {})

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    tmp = Path(port_file + ".tmp")
    tmp.write_text(str(server.server_address[1]))
    tmp.rename(port_file)
    server.serve_forever(poll_interval=0.05)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
