"""Model and data fetched once per cluster, before the job is submitted (fab's side).

ops/actions/fetch_files.py does the fetching on a cluster host (the controller, into the shared
/scratch): resumable, verified, skipped when complete. This module builds its manifest, runs
it there and turns its progress lines into "3.2 of 8.1 GB at 140 MB/s, 35 s left", so a failed
download fails before any GPU is allocated, and every rank can then run offline.

A gated or private model needs the user's Hugging Face token (`hub_token`: HF_TOKEN, else the login
`hf auth login` stored). It is read here, sent with this machine's one API call (`hub_manifest`)
and written only into the fetch program's stdin on the controller (`run`): never into a command
line, the environment, a file, user-data, a job or a log. A refusal from the Hub (401, 403) is an
error naming the model's page and the fix before anything is submitted (`_refused`).
"""

from __future__ import annotations

import io
import json
import re
import shlex
import uuid
from collections.abc import Callable
from pathlib import Path

from cluster.errors import UserError
from ops.actions.fetch_files import UnsafeName, open_url, redact, safe_name
from ops.say import Say, shown
from ops.ssh.remote import put_bytes

SCRIPT = Path(__file__).resolve().parent / "fetch_files.py"
# A Hub commit: the revision API's "sha" is the commit's 40 hex digits
# (https://huggingface.co/docs/hub/api: GET /api/models/{repo_id}/revision/{revision}).
_COMMIT = re.compile(r"[0-9a-f]{40}")


class PrefetchError(UserError, RuntimeError):
    pass


def manifest_of_dir(source: str, dest: str, sizes: dict[str, int], sha256: dict[str, str] | None = None,
                    root: str | None = None) -> dict:
    """A manifest of `sizes` (relative path -> bytes) from `source` (a URL or a directory) into `dest`;
    `root`: the fetch area above dest, from which fetch_files.py walks down without following links."""
    files = [{"path": p, "size": int(n), **({"sha256": sha256[p]} if sha256 and p in sha256 else {})}
             for p, n in sorted(sizes.items())]
    if not files:
        raise PrefetchError(f"nothing to fetch from {source}: the manifest is empty")
    return {"source": source, "dest": dest, "files": files, **({"root": root} if root else {})}


def hub_endpoint() -> str:
    """The Hub's address: HF_ENDPOINT, as huggingface_hub reads it."""
    import os

    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


class HubToken(str):
    """The user's Hugging Face token; `where` names its source for the errors (never the value)."""

    where: str = "HF_TOKEN"

    def __repr__(self) -> str:  # a traceback's or a debug print's view of it
        return "HubToken([hidden])"


def hub_token() -> HubToken | None:
    """The user's Hugging Face token, found as huggingface_hub finds it (`get_token`: HF_TOKEN, then
    the token file `hf auth login` writes under HF_HOME; huggingface_hub/utils/_auth.py); None when
    there is none. Only printable characters: the value becomes an HTTP header."""
    import os

    from huggingface_hub import get_token

    value = get_token()
    if not value:
        return None
    token = HubToken(value)
    token.where = ("HF_TOKEN" if os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
                   else "your Hugging Face login (`hf auth login`)")
    if not re.fullmatch(r"[\x21-\x7e]+", token):
        raise PrefetchError(f"the Hugging Face token from {token.where} has a space or a character that is not "
                            "printable ASCII; set HF_TOKEN to the token alone (https://huggingface.co/settings/tokens)")
    return token


def _refused(repo_id: str, page: str, status: int, token: HubToken | None) -> PrefetchError:
    """The Hub's 401 or 403 as the fix: no token for a gated (or private) repository, a token the
    Hub does not know, or a token whose user has not accepted the license (gated repositories:
    https://huggingface.co/docs/hub/models-gated; the codes as huggingface_hub's hf_raise_for_status
    reads them, huggingface_hub/utils/_http.py)."""
    if token is None:
        return PrefetchError(f"{repo_id} is gated or private and no Hugging Face token was found: set HF_TOKEN or run "
                             f"`hf auth login` ({page})")
    if status == 403:
        return PrefetchError(f"{repo_id} is gated and the Hugging Face token from {token.where} has no access to it: "
                             f"accept the license at {page} and use a token with access (HF_TOKEN or `hf auth login`)")
    return PrefetchError(f"the Hub refuses the Hugging Face token from {token.where} for {repo_id} (HTTP 401: "
                         "expired, revoked or mistyped): make a new read token at "
                         "https://huggingface.co/settings/tokens and set HF_TOKEN or run `hf auth login` "
                         f"(then accept the license at {page} if the model is gated)")


def hub_manifest(repo_id: str, dest_root: str, kind: str = "models", revision: str = "main",
                 endpoint: str | None = None, token: HubToken | None = None) -> dict:
    """The manifest of a Hub repository's files at `revision` (sizes and LFS sha256 from the Hub's
    API, read from here with `token` when given) into <dest_root>/<kind>/<repo>@<commit>: a new
    commit is a new directory."""
    import urllib.error

    endpoint = endpoint or hub_endpoint()
    url = f"{endpoint}/api/{kind}/{repo_id}/revision/{revision}?blobs=true"
    prefix = "" if kind == "models" else f"{kind}/"
    try:
        with open_url(url, token, timeout=30) as resp:  # the Hub's API
            info = json.load(resp)
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            raise _refused(repo_id, f"{endpoint}/{prefix}{repo_id}", exc.code, token) from None
        raise PrefetchError(f"{repo_id}: the Hub's file list ({url}) could not be read: HTTP {exc.code}; check "
                            "the ID and this machine's network (or HF_ENDPOINT)") from None
    except (urllib.error.URLError, ValueError) as exc:
        raise PrefetchError(f"{repo_id}: the Hub's file list ({url}) could not be read: {exc}; check the ID "
                            "and this machine's network (or HF_ENDPOINT)") from None
    if not isinstance(info, dict):
        raise PrefetchError(f"{repo_id}: the Hub's answer ({url}) is a {type(info).__name__}, not an object with "
                            "sha and siblings; nothing is fetched (check HF_ENDPOINT)")
    sha = info.get("sha") or revision
    siblings = info.get("siblings") or []
    if not isinstance(siblings, list) or not all(isinstance(s, dict) for s in siblings):
        raise PrefetchError(f"{repo_id}: the Hub's answer ({url}) has no list of files (siblings); nothing is fetched")
    for s in siblings:  # sizes and sums become the fetch's plan: a count of bytes, a digest
        size, lfs = s.get("size"), s.get("lfs")
        if size is not None and not (isinstance(size, int) and not isinstance(size, bool) and size >= 0):
            raise PrefetchError(f"{repo_id}: the Hub's answer ({url}) gives {s.get('rfilename')!r:.80} the size "
                                f"{size!r:.40}, not a count of bytes; nothing is fetched")
        if lfs is not None and not (isinstance(lfs, dict) and isinstance(lfs.get("sha256") or "", str)
                                    and re.fullmatch(r"(?:[0-9a-f]{64})?", lfs.get("sha256") or "")):
            raise PrefetchError(f"{repo_id}: the Hub's answer ({url}) gives {s.get('rfilename')!r:.80} the lfs "
                                f"{lfs!r:.80}, not {{sha256: 64 hex digits}}; nothing is fetched")
    try:  # the answer's names become paths on /scratch: each must stay in its folder (fetch_files.safe_name)
        safe_name(repo_id, nested=True)
        if not (isinstance(sha, str) and _COMMIT.fullmatch(sha)) and sha != safe_name(revision):
            raise UnsafeName(f"sha {sha!r}: not a commit id (40 hex digits)")
        for s in siblings:
            safe_name(s.get("rfilename"), nested=True)
    except UnsafeName as exc:
        raise PrefetchError(f"{repo_id}: the Hub's answer ({url}) names {exc}; nothing is fetched") from None
    sizes = {s["rfilename"]: s["size"] for s in siblings if s.get("size") is not None}
    sums = {s["rfilename"]: s["lfs"]["sha256"] for s in siblings if (s.get("lfs") or {}).get("sha256")}
    return manifest_of_dir(f"{endpoint}/{prefix}{repo_id}/resolve/{sha}", f"{dest_root}/{kind}/{repo_id}@{sha}",
                           sizes, sums, root=dest_root)


def hub_config(repo_id: str, revision: str = "main", endpoint: str | None = None,
               token: HubToken | None = None) -> dict:
    """A Hub model's config.json alone (its sizes: the fit check before launch, ops/cost/fit.py), read from
    here with `token` as the file list is (`hub_manifest`); no weight is downloaded. The file's URL as
    huggingface_hub's hf_hub_url builds it: {endpoint}/{repo_id}/resolve/{revision}/config.json."""
    import urllib.error

    endpoint = endpoint or hub_endpoint()
    url = f"{endpoint}/{repo_id}/resolve/{revision}/config.json"
    try:
        with open_url(url, token, timeout=30) as resp:
            config = json.loads(resp.read(1 << 20))  # a config.json is a few kB
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            raise _refused(repo_id, f"{endpoint}/{repo_id}", exc.code, token) from None
        raise PrefetchError(f"model {repo_id}: its config.json ({url}) could not be read: HTTP {exc.code}; check "
                            "the model ID (a Hub model repository with a config.json)") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise PrefetchError(f"model {repo_id}: its config.json ({url}) could not be read: {exc}; check this "
                            "machine's network (or HF_ENDPOINT) and the model ID") from None
    if not isinstance(config, dict):
        raise PrefetchError(f"model {repo_id}: its config.json ({url}) is not a JSON object")
    return config


def fetch_inputs(cl, opts, say: Say):
    """Fetch the run's Hub model and data set (flags or config) once into the shared /scratch, on the
    controller, before anything is submitted; return the options naming the local copies, which
    every rank reads offline. Absolute paths are left as they are."""
    import dataclasses

    changes = {}
    wanted = [(flag, kind, value) for flag, kind, value in (("model", "models", opts.model_path),
                                                            ("data", "datasets", opts.data_path))
              if value and not value.startswith("/")]
    token = hub_token() if wanted else None
    for flag, kind, value in wanted:
        manifest = hub_manifest(value, f"{cl.inventory.scratch}/hub", kind, token=token)
        run(cl.controller, "python3", manifest, f"{flag} {value}", lambda s: say("      " + s), token=token)
        path = manifest["dest"]
        if kind == "datasets" and any(f["path"].startswith("data/") for f in manifest["files"]):
            path += "/data"  # the data files of a Hub data set (training/data.py reads a directory of them)
        changes[flag] = path
    return dataclasses.replace(opts, **changes) if changes else opts


def describe(event: dict, what: str) -> str:
    """One progress line: bytes done of total, rate, time left."""
    done, total, rate = event.get("done", 0), event.get("total", 0), event.get("rate", 0)
    left = event.get("left_s")
    return (f"{what}: {done / 1e9:.2f} of {total / 1e9:.2f} GB at {rate / 1e6:.0f} MB/s"
            + (f", {left:.0f} s left" if left is not None else ""))


class _Lines(io.TextIOBase):
    """A stream that hands each complete line to `fn` (Fabric's out_stream)."""

    def __init__(self, fn: Callable[[str], None]) -> None:
        self.fn, self.buf = fn, ""

    def write(self, s: str) -> int:
        self.buf += s
        *lines, self.buf = self.buf.split("\n")
        for line in lines:
            self.fn(line)
        return len(s)


def on_line(line: str, what: str, say: Say, result: dict) -> None:
    if line.startswith("FETCH_DONE "):
        result.update(json.loads(line[len("FETCH_DONE "):]))
    elif line.startswith("FETCH "):
        say(shown(describe(json.loads(line[len("FETCH "):]), what)))  # the controller's words


def run(conn, python: str, manifest: dict, what: str, say: Say, token: str | None = None) -> dict:
    """Fetch `manifest` on the host of `conn` (ops/actions/fetch_files.py with its python3); the result
    dict. `token` travels inside the program's stdin (beside the manifest), the one way to that host
    that no command line, environment or file shows."""
    remote = f"/tmp/slurm-gpu-fetch-{uuid.uuid4().hex[:12]}.py"
    put_bytes(conn, SCRIPT.read_bytes(), remote)
    result: dict = {}
    try:
        # -I: nothing a job left in /tmp beside the script is imported (it runs as the admin user).
        res = conn.run(f"{shlex.quote(python)} -I {shlex.quote(remote)}", hide=True, warn=True,
                       in_stream=io.StringIO(json.dumps({**manifest, **({"token": str(token)} if token else {})})),
                       out_stream=_Lines(lambda line: on_line(line, what, say, result)))
    finally:
        conn.run(f"rm -f {shlex.quote(remote)}", hide=True, warn=True, in_stream=False)
    if not res.ok or not result:
        err = redact(res.stderr or "", token)  # masked there already; and here, whatever printed it
        why = [ln for ln in err.splitlines() if ln.startswith("fetch error:")]
        raise PrefetchError(f"fetching {what} into {manifest['dest']} failed: "
                            f"{shown(why[-1] if why else err.strip()[-400:])}")
    say(f"{what}: already complete in {manifest['dest']}" if result.get("skipped") else
        f"{what}: {result['bytes'] / 1e9:.2f} GB fetched into {manifest['dest']}, verified")
    return result
