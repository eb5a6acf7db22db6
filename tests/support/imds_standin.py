"""A stand-in for the EC2 instance metadata service (IMDSv2), on loopback only.

PUT /latest/api/token gives a token; GETs without a valid one answer 401. The notices come from a
JSON file read at every request (the test writes it): {"instance-action": {...} | absent,
"rebalance": {...} | absent, "revoke": bool, "credentials": {"role": NAME, "AccessKeyId": ..., ...} |
absent}; an item that is absent answers 404, as the real service does. `credentials` answers as an
instance role does: .../iam/security-credentials/ lists NAME, .../NAME gives the rest (the path and
fields botocore's InstanceMetadataFetcher reads: botocore/utils.py). `revoke` makes every token issued so far invalid (as one that expired). Run inside a local
cluster host's namespace: `python tests/support/imds_standin.py PORT STATE_FILE` serves that host's 127.0.0.1.
"""

from __future__ import annotations

import json
import secrets
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ITEMS = {"/latest/meta-data/spot/instance-action": "instance-action",
         "/latest/meta-data/events/recommendations/rebalance": "rebalance"}
ROLE_PATH = "/latest/meta-data/iam/security-credentials/"


class Standin(ThreadingHTTPServer):
    def __init__(self, port: int, state: Path):
        super().__init__(("127.0.0.1", port), Handler)
        self.state, self.tokens, self.issued = state, set(), 0

    def notices(self) -> dict:
        try:
            return json.loads(self.state.read_text() or "{}")
        except FileNotFoundError:
            return {}


class Handler(BaseHTTPRequestHandler):
    server: Standin

    def log_message(self, *args):  # quiet
        pass

    def _send(self, code: int, body: str = "") -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_PUT(self):
        if self.path != "/latest/api/token" or not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            return self._send(400)
        token = secrets.token_hex(16)
        self.server.tokens.add(token)
        self.server.issued += 1
        self._send(200, token)

    def do_GET(self):
        state = self.server.notices()
        if state.get("revoke"):
            self.server.tokens.clear()
            state.pop("revoke")
            self.server.state.write_text(json.dumps(state))
        if self.headers.get("X-aws-ec2-metadata-token") not in self.server.tokens:
            return self._send(401)
        creds = dict(state.get("credentials") or {})
        role = creds.pop("role", None)
        if role and self.path == f"{ROLE_PATH}{role}":
            return self._send(200, json.dumps(creds))
        if role and self.path == ROLE_PATH:
            return self._send(200, role)
        item = ITEMS.get(self.path)
        if item is None or state.get(item) is None:
            return self._send(404)
        self._send(200, json.dumps(state[item]))


def serve_in_thread(port: int, state: Path) -> Standin:
    server = Standin(port, state)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


if __name__ == "__main__":
    Standin(int(sys.argv[1]), Path(sys.argv[2])).serve_forever()
