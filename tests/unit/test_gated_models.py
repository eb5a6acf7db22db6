"""Gated models (ops/actions/prefetch.py, fetch_files.py): the user's Hugging Face token reaches only
the fetch program's stdin, and a refusal from the Hub is an error naming the model's page and the fix.

A stand-in hub on loopback answers as the Hub does for a gated repository (401 without a token or
with an unknown one, 403 for a user without the accepted license; the headers huggingface_hub's
hf_raise_for_status reads, huggingface_hub/utils/_http.py) and sends a weight file from a second
"CDN" address, as the Hub does. The real huggingface_hub client checks the stand-in's dialect, stores
a login in it, and fab's side finds the token as it does for a user: from HF_TOKEN or that login.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import invoke
import pytest

from ops.actions import prefetch

REPO = Path(__file__).resolve().parents[2]
SHA = "89abcdef0123456789abcdef0123456789abcdef"
GOOD = "hf_standInGoodToken7f3a9c"  # a user who accepted the license
NO_LICENSE = "hf_standInNoLicense51e0b2"  # a known user who did not
FILES = {"config.json": b'{"model_type": "qwen3"}', "model.safetensors": os.urandom(3 << 20)}
BROKEN = "z-shard.bin"  # org/broken: answers 500 after the first files arrived, quoting the request's token


class StandInHub(http.server.BaseHTTPRequestHandler):
    """The Hub's API (file list, whoami) and file downloads for org/gated and org/broken, behind a gate."""

    seen: list[tuple[str, str, str | None]] = []  # (server, path, Authorization)
    cdn: str = ""

    def log_message(self, *args):
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, reason: str | None = None):
        self.send_response(status, reason)
        for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _gate(self) -> bool:
        """Whether the request may pass; else the Hub's answer sent (huggingface_hub/utils/_http.py)."""
        auth = self.headers.get("Authorization")
        if auth is None:
            self._send(401, headers={"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to this model is "
                                     "restricted. You must have access to it and be authenticated to access it."})
        elif auth == f"Bearer {NO_LICENSE}":
            self._send(403, headers={"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to this model is "
                                     "restricted and you are not in the authorized list."})
        elif auth != f"Bearer {GOOD}":
            self._send(401, headers={"X-Error-Message": "Invalid credentials in Authorization header"})
        else:
            return True
        return False

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        auth = self.headers.get("Authorization")
        StandInHub.seen.append(("hub", self.path, auth))
        path = self.path.split("?")[0]
        if path == "/api/whoami-v2":
            if auth in (f"Bearer {GOOD}", f"Bearer {NO_LICENSE}"):
                body = {"name": "tester", "auth": {"accessToken": {"displayName": "stand-in", "role": "read"}}}
                self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})
            else:
                self._send(401, headers={"X-Error-Message": "Invalid credentials in Authorization header"})
            return
        for repo in ("org/gated", "org/broken"):
            files = {**FILES, **({BROKEN: b"x" * 10} if repo == "org/broken" else {})}
            if path.startswith(f"/api/models/{repo}"):
                if self._gate():
                    siblings = [{"rfilename": n, "size": len(b), "blobId": "0" * 40,
                                 "lfs": {"size": len(b), "sha256": hashlib.sha256(b).hexdigest(), "pointerSize": 134}}
                                for n, b in files.items()]
                    body = {"id": repo, "modelId": repo, "sha": SHA, "gated": "manual", "private": False,
                            "siblings": siblings}
                    self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})
                return
            if path.startswith(f"/{repo}/resolve/"):
                name = path.rsplit("/", 1)[1]
                if not self._gate():
                    return
                if name == BROKEN:  # a server whose error quotes what it was sent
                    self._send(500, reason=f"upstream refused {auth}")
                elif name == "model.safetensors":  # the weights come from the CDN, at an address signed for them
                    self._send(302, headers={"Location": f"{StandInHub.cdn}/signed/{name}?sig=abc"})
                elif name in files:
                    self._send(200, files[name], {"ETag": '"e"', "X-Repo-Commit": SHA})
                else:
                    self._send(404, headers={"X-Error-Code": "EntryNotFound"})
                return
        self._send(404, headers={"X-Error-Code": "RepoNotFound"})


class StandInCDN(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        StandInHub.seen.append(("cdn", self.path, self.headers.get("Authorization")))
        body = FILES[self.path.split("?")[0].rsplit("/", 1)[1]]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def hub():
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), h) for h in (StandInHub, StandInCDN)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    StandInHub.seen, StandInHub.cdn = [], f"http://127.0.0.1:{servers[1].server_port}"
    yield f"http://127.0.0.1:{servers[0].server_port}"
    for s in servers:
        s.shutdown()


def _env(hub: str, home: Path, token: str | None = None) -> dict:
    """A user's environment: HF_ENDPOINT at the stand-in, their own HF_HOME, HF_TOKEN or none."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE", "HF_HUB_OFFLINE")}
    env.update(HF_ENDPOINT=hub, HF_HOME=str(home), PYTHONPATH=str(REPO), **({"HF_TOKEN": token} if token else {}))
    return env


FAB_SIDE = """
import json, sys
from ops.actions import prefetch
try:
    token = prefetch.hub_token()
    print(json.dumps({"where": token and token.where,
                      "manifest": prefetch.hub_manifest(sys.argv[1], "/scratch/hub", token=token)}))
except prefetch.PrefetchError as exc:
    print("ERROR " + str(exc))
"""


def _fab_side(env: dict, repo: str = "org/gated") -> str:
    """fab's side in a process of its own, as the user runs it: the token found, the file list read."""
    res = subprocess.run([sys.executable, "-c", FAB_SIDE, repo], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def test_the_stand_in_answers_the_real_client_as_the_hub_does(hub):
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError

    api = HfApi(endpoint=hub)
    with pytest.raises(GatedRepoError):
        api.model_info("org/gated", token=False)
    with pytest.raises(GatedRepoError):
        api.model_info("org/gated", token=NO_LICENSE)
    with pytest.raises(HfHubHTTPError, match="401"):
        api.model_info("org/gated", token="hf_wrong")
    info = api.model_info("org/gated", revision="main", files_metadata=True, token=GOOD)
    assert info.sha == SHA and sorted(s.rfilename for s in info.siblings) == sorted(FILES)


def test_without_a_token_a_gated_model_is_refused_naming_its_page(hub, tmp_path):
    out = _fab_side(_env(hub, tmp_path / "hf-home"))
    assert out == ("ERROR org/gated is gated or private and no Hugging Face token was found: set HF_TOKEN or run "
                   f"`hf auth login` ({hub}/org/gated)")


def test_a_token_the_hub_refuses_names_its_source_and_the_fix_but_not_its_value(hub, tmp_path):
    wrong = "hf_revokedTokenQq81"
    out = _fab_side(_env(hub, tmp_path / "hf-home", wrong))
    assert out.startswith("ERROR the Hub refuses the Hugging Face token from HF_TOKEN for org/gated (HTTP 401")
    assert "https://huggingface.co/settings/tokens" in out and f"{hub}/org/gated" in out
    assert wrong not in out


def test_a_token_without_the_accepted_license_is_told_to_accept_it(hub, tmp_path):
    out = _fab_side(_env(hub, tmp_path / "hf-home", NO_LICENSE))
    assert out.startswith("ERROR org/gated is gated and the Hugging Face token from HF_TOKEN has no access")
    assert f"accept the license at {hub}/org/gated" in out and NO_LICENSE not in out


def test_the_token_of_a_stored_login_is_found_and_sent(hub, tmp_path):
    home = tmp_path / "hf-home"
    env = _env(hub, home)
    login = subprocess.run([sys.executable, "-c", f"import huggingface_hub; huggingface_hub.login(token={GOOD!r})"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert login.returncode == 0, login.stderr
    assert GOOD in (home / "token").read_text()  # written by huggingface_hub itself
    got = json.loads(_fab_side(env))
    assert got["where"] == "your Hugging Face login (`hf auth login`)"
    assert got["manifest"]["dest"] == f"/scratch/hub/models/org/gated@{SHA}"
    assert ("hub", "/api/models/org/gated/revision/main?blobs=true", f"Bearer {GOOD}") in StandInHub.seen


class LocalHost:
    """A Fabric Connection's put and run, on this machine: invoke runs the very command fab builds (the
    runner under Fabric's own), with no environment of ours (a remote shell has no HF_TOKEN)."""

    def __init__(self) -> None:
        self.commands: list[str] = []

    def put(self, local, remote):
        Path(remote).write_bytes(local.read())

    def run(self, command, **kw):
        self.commands.append(command)
        return invoke.Context().run(command, env={"PATH": os.environ["PATH"]}, replace_env=True, **kw)


def _token_in(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and GOOD.encode() in p.read_bytes()]


def test_with_the_token_the_model_arrives_and_the_token_is_nowhere_but_stdin(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", GOOD)
    token = prefetch.hub_token()
    assert token == GOOD and token.where == "HF_TOKEN" and GOOD not in repr(token)
    scratch = tmp_path / "scratch"
    manifest = prefetch.hub_manifest("org/gated", str(scratch / "hub"), endpoint=hub, token=token)
    host, said = LocalHost(), []
    result = prefetch.run(host, sys.executable, manifest, "model org/gated", said.append, token=token)
    assert result["files"] == 2
    dest = Path(manifest["dest"])
    assert {n: (dest / n).read_bytes() for n in FILES} == FILES
    assert host.commands and not [c for c in host.commands if GOOD in c]  # the command lines (ps)
    assert not [s for s in said if GOOD in s] and not _token_in(scratch)  # what the user reads; the files
    auth = {(where, path.split("?")[0]): a for where, path, a in StandInHub.seen}
    assert auth[("hub", f"/org/gated/resolve/{SHA}/model.safetensors")] == f"Bearer {GOOD}"
    assert auth[("cdn", "/signed/model.safetensors")] is None  # the redirect to another host goes without it


def test_a_failed_download_names_the_file_but_never_the_token(hub, tmp_path):
    token = prefetch.HubToken(GOOD)
    scratch = tmp_path / "scratch"
    manifest = prefetch.hub_manifest("org/broken", str(scratch / "hub"), endpoint=hub, token=token)
    res = subprocess.run([sys.executable, "-I", str(prefetch.SCRIPT)], input=json.dumps({**manifest, "token": GOOD}),
                         capture_output=True, text=True, timeout=60, env={"PATH": os.environ["PATH"]})
    assert res.returncode == 1
    assert "fetch error: HTTP Error 500: upstream refused Bearer [token]" in res.stderr  # the server quoted it
    assert GOOD not in res.stdout + res.stderr and not _token_in(scratch)
    assert (Path(manifest["dest"]) / "config.json").read_bytes() == FILES["config.json"]  # mid-download

    shutil.rmtree(scratch)
    with pytest.raises(prefetch.PrefetchError) as err:
        prefetch.run(LocalHost(), sys.executable, manifest, "model org/broken", lambda s: None, token=token)
    assert "HTTP Error 500" in str(err.value) and GOOD not in str(err.value) and not _token_in(scratch)


def test_a_token_with_a_space_is_refused_without_showing_it(hub, tmp_path):
    out = _fab_side(_env(hub, tmp_path / "hf-home", "hf_abc def"))
    assert out.startswith("ERROR the Hugging Face token from HF_TOKEN has a space") and "abc def" not in out
