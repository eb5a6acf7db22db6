"""fab's side of the prefetch (ops.actions.prefetch.run) on the real local cluster: the controller fetches
from an HTTP server on the project's bridge address into the shared /scratch, every GPU node
then sees the files; a second fetch reads nothing; a wrong checksum fails before any job."""

import hashlib
import http.server
import json
import os
import shutil
import threading
from pathlib import Path

import pytest

from ops.actions import prefetch
from ops.ssh.remote import connect
from tests.support.local_cluster import fresh_cluster
from tests.unit.test_prefetch import RangeHandler

# Hub commits: 40 hex digits, as the revision API answers (prefetch refuses anything else).
TINY_SHA, ROWS_SHA = "a" * 40, "b" * 40

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster_and_source(tmp_path_factory):
    from localcluster import topology as layout

    src = tmp_path_factory.mktemp("hub")
    files = {"model.safetensors": os.urandom(4 << 20), "config.json": b'{"model_type": "qwen3"}'}
    for name, data in files.items():
        (src / name).write_bytes(data)
    handler = lambda *a, **kw: RangeHandler(*a, directory=str(src), **kw)  # noqa: E731
    with fresh_cluster(nodes=2, gpus=1) as (inv, _job_dirs):
        server = http.server.ThreadingHTTPServer((layout.BRIDGE_IP, 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        cl = connect(inv)
        try:
            yield cl, f"http://{layout.BRIDGE_IP}:{server.server_port}", files
        finally:
            cl.close()
            server.shutdown()
            shutil.rmtree(layout.SCRATCH / "prefetch-test", ignore_errors=True)


def test_controller_fetches_into_scratch_once_and_nodes_see_it(cluster_and_source):
    cl, url, files = cluster_and_source
    dest = f"{cl.inventory.scratch}/prefetch-test/model"
    manifest = prefetch.manifest_of_dir(url, dest, {k: len(v) for k, v in files.items()},
                                        {k: hashlib.sha256(v).hexdigest() for k, v in files.items()})
    said: list[str] = []
    RangeHandler.served = {}
    result = prefetch.run(cl.controller, "python3", manifest, "model", said.append)
    assert result["bytes"] == sum(map(len, files.values())) and not result["skipped"]
    assert any(" GB at " in s for s in said) and said[-1].endswith("verified"), said
    for name, conn in cl.nodes.items():
        out = conn.run(f"sha256sum {dest}/model.safetensors", hide=True, in_stream=False).stdout
        assert out.split()[0] == hashlib.sha256(files["model.safetensors"]).hexdigest(), name

    RangeHandler.served = {}
    again = prefetch.run(cl.controller, "python3", manifest, "model", said.append)
    assert again["skipped"] and RangeHandler.served == {} and "already complete" in said[-1]


def test_a_failed_fetch_is_a_clear_error(cluster_and_source):
    cl, url, files = cluster_and_source
    dest = f"{cl.inventory.scratch}/prefetch-test/bad"
    manifest = prefetch.manifest_of_dir(url, dest, {"config.json": len(files["config.json"])},
                                        {"config.json": "0" * 64})
    with pytest.raises(prefetch.PrefetchError, match="config.json: sha256 differs"):
        prefetch.run(cl.controller, "python3", manifest, "model", lambda s: None)


def test_fab_train_fetches_hub_ids_into_scratch_and_names_the_copies(cluster_and_source, monkeypatch, tmp_path):
    """fetch_inputs, as `fab train` calls it: a Hub model and data set (here a Hub on the bridge
    address, HF_ENDPOINT, serving the Hub's file-list API and resolve URLs) become /scratch paths."""
    from localcluster import topology as layout
    from ops.actions.options import TrainOptions

    cl, _url, _files = cluster_and_source
    hub = tmp_path / "hub"
    blobs = {("models", "org/tiny", TINY_SHA): {"config.json": b'{"model_type": "qwen3"}', "w.bin": os.urandom(1 << 20)},
             ("datasets", "org/rows", ROWS_SHA): {"data/train.jsonl": b'{"instruction": "a", "output": "b"}\n',
                                                   "README.md": b"# rows\n"}}
    for (kind, repo, sha), files in blobs.items():
        api = hub / "api" / kind / repo / "revision" / "main"
        api.parent.mkdir(parents=True)
        api.write_text(json.dumps({"sha": sha, "siblings": [
            {"rfilename": n, "size": len(d), "lfs": {"sha256": hashlib.sha256(d).hexdigest()}} for n, d in files.items()]}))
        base = hub / ("" if kind == "models" else kind) / repo / "resolve" / sha
        for name, data in files.items():
            (base / name).parent.mkdir(parents=True, exist_ok=True)
            (base / name).write_bytes(data)
    handler = lambda *a, **kw: RangeHandler(*a, directory=str(hub), **kw)  # noqa: E731
    server = http.server.ThreadingHTTPServer((layout.BRIDGE_IP, 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://{layout.BRIDGE_IP}:{server.server_port}")
    opts = TrainOptions(target="local", stack=None, config=Path("x.yaml"), nodes=None, gpus_per_node=None,
                        examples=None, model="org/tiny", data="org/rows", identity=None)
    said: list[str] = []
    try:
        got = prefetch.fetch_inputs(cl, opts, said.append)
    finally:
        server.shutdown()
    scratch = cl.inventory.scratch
    assert got.model == f"{scratch}/hub/models/org/tiny@{TINY_SHA}"
    assert got.data == f"{scratch}/hub/datasets/org/rows@{ROWS_SHA}/data"
    local = layout.SCRATCH / "hub"
    try:
        assert (local / f"models/org/tiny@{TINY_SHA}/w.bin").read_bytes() == blobs[("models", "org/tiny", TINY_SHA)]["w.bin"]
        assert (local / f"datasets/org/rows@{ROWS_SHA}/data/train.jsonl").is_file()
        assert any("verified" in s for s in said), said
    finally:
        shutil.rmtree(local, ignore_errors=True)
