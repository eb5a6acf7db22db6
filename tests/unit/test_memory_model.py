"""The fit check before launch (training/memory_model.py, ops/cost/fit.py; docs/MEMORY.md).

The parameter count from config.json is held to transformers' own model built from the same config on the meta
device (no memory, no weights), for the Qwen3 family's published shapes: tests/data/qwen3_configs/ holds their
config.json values as the model pages give them (https://huggingface.co/Qwen/Qwen3-0.6B/blob/main/config.json,
and likewise Qwen3-4B, Qwen3-8B, Qwen3-14B, Qwen3-32B). The LoRA count is held to PEFT's on the same meta model.
The verdicts on the default cluster (g6.12xlarge, 4 L4s a node, 2 nodes) and on p5.48xlarge (8 H100 80 GB) are
the model's; the config.json of a Hub model comes from a stand-in hub on loopback, as from the Hub.
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import re
import threading
from pathlib import Path

import pytest
from fabric import Config
from invoke import Context
from invoke.exceptions import Exit

import fabfile
from localcluster import plan as local_plan
from ops.actions import options
from ops.cost import fit
from ops.finetune import pipeline as finetune
from ops.finetune import runs
from training import memory_model as mm
from training.validate import default

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "qwen3_configs"
REPO = Path(__file__).resolve().parents[2]
SIZES = ("0.6B", "4B", "8B", "14B", "32B")
GIB = 2**30


def qwen3(size: str) -> dict:
    return json.loads((CONFIGS / f"Qwen3-{size}.json").read_text())


def meta_model(config: dict):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with torch.device("meta"):
        return Qwen3ForCausalLM(Qwen3Config(**config))


@pytest.mark.parametrize("size", SIZES)
def test_parameter_count_is_transformers_own_count_of_the_same_config(size):
    config = qwen3(size)
    model = meta_model(config)
    assert mm.parameter_count(config) == sum(p.numel() for p in model.parameters())


def test_lora_count_is_peft_own_count_on_the_same_model():
    from peft import LoraConfig, get_peft_model

    config = qwen3("4B")
    for targets in (["q_proj", "k_proj", "v_proj", "o_proj"], ["q_proj", "v_proj", "gate_proj", "down_proj"]):
        peft_model = get_peft_model(meta_model(config), LoraConfig(r=16, target_modules=targets))
        trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
        assert mm.lora_parameters(config, 16, targets) == trainable


def setting_with(**given):
    return lambda key: given[key] if key in given else default(key)


# The premise: Qwen3-4B fits an L4 with room, Qwen3-8B barely, 14B and 32B not unsharded; on an H100 all
# of them. sharding auto (the default) shards 14B and 32B over the 8 L4s, and then they fit.
VERDICTS = [("4B", "g6.12xlarge", 1), ("8B", "g6.12xlarge", 1), ("14B", "g6.12xlarge", 8),
            ("32B", "g6.12xlarge", 8), ("4B", "p5.48xlarge", 1), ("8B", "p5.48xlarge", 1),
            ("14B", "p5.48xlarge", 1), ("32B", "p5.48xlarge", 1)]


@pytest.mark.parametrize("size,itype,shards", VERDICTS, ids=[f"{s}-{t}" for s, t, _f in VERDICTS])
def test_verdicts_of_the_default_recipe(size, itype, shards):
    v = fit.check(qwen3(size), default, itype, 8, "ap-northeast-2")
    assert v.fits and v.plan.shards == shards and v.change is None and "fits with" in v.lines(size)[0]
    assert v.peak == pytest.approx(sum(mm.breakdown(qwen3(size), v.plan).values()))
    assert v.usable == {"g6.12xlarge": 23034, "p5.48xlarge": 81559}[itype] * 2**20
    if shards > 1:  # auto sharded it because the unsharded run does not fit, and says so
        assert "sharding auto: the base sharded 8-way" in " ".join(v.plan.notes)
        unsharded = fit.check(qwen3(size), setting_with(sharding="none"), itype, 8, "ap-northeast-2")
        assert not unsharded.fits and unsharded.plan.shards == 1


@pytest.mark.parametrize("size", ["14B", "32B"])
def test_sharding_none_names_sharding_or_a_bigger_gpu(size):
    v = fit.check(qwen3(size), setting_with(sharding="none"), "g6.12xlarge", 8, "ap-northeast-2")
    assert not v.fits and v.change is not None and v.change.plan.shards == 8
    assert mm.peak_bytes(qwen3(size), v.change.plan) <= v.usable
    assert "cheapest change that fits: sharding: fsdp (the base sharded 8-way" in " ".join(v.advice())
    assert "not yet supported" not in " ".join(v.advice())
    assert v.bigger and fit.gpu_memory(v.bigger[0][0])[1] >= v.peak


def test_sharding_fsdp_shards_a_model_that_fits_unsharded_too():
    v = fit.check(qwen3("4B"), setting_with(sharding="fsdp"), "g6.12xlarge", 8)
    assert v.fits and v.plan.shards == 8 and "sharding fsdp: the base sharded 8-way (config)" in v.plan.notes
    assert v.terms["base_weights"] == pytest.approx(mm.parameter_count(qwen3("4B")) * 2 / 8)


def test_sharding_asked_with_one_rank_is_refused_naming_the_setting():
    with pytest.raises(fit.FitError, match=r"^sharding: fsdp needs 2 or more ranks to shard over; this run has 1: "
                                           r"set sharding to auto or none"):
        fit.check(qwen3("4B"), setting_with(sharding="fsdp"), "g6.12xlarge", 1)
    # auto with one rank: nothing to shard over, so the run is checked unsharded
    assert fit.check(qwen3("4B"), default, "g6.12xlarge", 1).plan.shards == 1


def test_8b_on_an_l4_fits_only_with_recomputation_which_the_run_turns_on_itself():
    v = fit.check(qwen3("8B"), default, "g6.12xlarge", 8)
    assert v.plan.checkpointing and "activation_checkpointing auto: on" in " ".join(v.plan.notes)
    off = fit.check(qwen3("8B"), setting_with(activation_checkpointing="false", sharding="none"), "g6.12xlarge", 8)
    assert not off.fits and off.change.what == "activation_checkpointing: true"
    # sharding auto: without recomputation it does not fit one L4 unsharded, so the run shards instead
    auto = fit.check(qwen3("8B"), setting_with(activation_checkpointing="false"), "g6.12xlarge", 8)
    assert auto.fits and auto.plan.shards == 8 and not auto.plan.checkpointing


def test_the_padded_path_advises_a_smaller_micro_batch_with_more_accumulation():
    setting = setting_with(flex_packing="false", per_device_train_batch_size=32, gradient_accumulation_steps=1,
                           max_length=2048)
    v = fit.check(qwen3("4B"), setting, "g6.12xlarge", 8)
    assert not v.fits and v.plan.checkpointing  # padded batches recompute unless the config says false
    # halving the micro-batch keeps the examples per step: 32 x 1 -> b x (32 / b)
    b, acc = (int(x.split(": ")[1]) for x in v.change.what.split(", "))
    assert b * acc == 32 and b < 32 and v.change_peak <= v.usable
    assert mm.peak_bytes(qwen3("4B"), dataclasses.replace(v.plan, tokens=2 * b * 2048)) > v.usable  # the largest


def test_every_term_scales_as_its_formula_says():
    config = qwen3("4B")
    one = mm.breakdown(config, mm.Plan(tokens=1024, ranks=4))
    two = mm.breakdown(config, mm.Plan(tokens=2048, ranks=4))
    assert two["activations"] == 2 * one["activations"] and two["base_weights"] == one["base_weights"]
    sharded = mm.breakdown(config, mm.Plan(tokens=1024, ranks=4, shards=4))
    assert sharded["base_weights"] == one["base_weights"] / 4 and sharded["gathered_weights"] > 0
    # without TRL's fused head the fp32 logits of Qwen's 151,936-entry vocabulary outweigh recomputed activations
    full = mm.breakdown(config, mm.Plan(tokens=8192, checkpointing=True, fused_lm_head=False))
    assert full["loss_head"] == 8192 * 151936 * mm.FULL_LOGITS_BYTES > full["activations"]


# ---------------------------------------------------------------- bad input


def test_sharding_needs_as_many_ranks_as_shards():
    with pytest.raises(ValueError, match="sharding 4-way needs at least 4 ranks; this run has 1"):
        mm.Plan(tokens=1024, ranks=1, shards=4)


def test_a_micro_batch_that_cannot_fit_even_sharded_is_refused_naming_it():
    setting = setting_with(flex_packing="false", per_device_train_batch_size=1, max_length=131072,
                           activation_checkpointing="true")
    v = fit.check(qwen3("32B"), setting, "g6.12xlarge", 8)
    assert v.plan.shards == 8  # sharding auto: sharded, and still too big
    assert not v.fits and v.bigger == [] and mm.peak_bytes(qwen3("32B"), v.plan) > v.usable
    assert v.change.what == "max_length: 8192" and v.change.plan.shards == 8  # shorter rows, still sharded
    with pytest.raises(fit.FitError) as info:
        fit.refuse_unless_fits(v, "Qwen/Qwen3-32B")
    msg = str(info.value)
    assert re.match(r"Qwen/Qwen3-32B does not fit one L4 of g6\.12xlarge: predicted peak \d+\.\d GiB per GPU "
                    r"sharded 8-way > 22\.5 GiB; cheapest change that fits: max_length: 8192", msg), msg
    assert "nothing was started" in msg
    # nothing at all fits: the message says that not even sharding does
    one_row = setting_with(flex_packing="false", per_device_train_batch_size=1, max_length=131072,
                           activation_checkpointing="true", sharding="fsdp", lora_r=2**16)
    with pytest.raises(fit.FitError, match="nothing fits: not even the base sharded 8-way with checkpointing"):
        fit.refuse_unless_fits(fit.check(qwen3("32B"), one_row, "g6.12xlarge", 8), "Qwen/Qwen3-32B")


@pytest.mark.parametrize("body,words", [
    (b'{"model_type": "qwen3"}', ["config.json field 'hidden_size' is None", "decoder-only"]),
    (b"not json", ["config.json", "could not be read"]),
])
def test_an_unreadable_config_names_the_model_and_the_fix(hub, monkeypatch, body, words):
    hub.files["org/odd"] = body
    with pytest.raises(fit.FitError) as info:
        fit.model_config("org/odd")
    assert "org/odd" in str(info.value) and all(w in str(info.value) for w in words), info.value


def test_a_missing_model_names_its_fix(hub):
    with pytest.raises(fit.FitError, match=r"org/none: its config.json .* HTTP 404; check the model ID"):
        fit.model_config("org/none")


@pytest.fixture
def gated_hub(monkeypatch, tmp_path):
    """tests/unit/test_gated_models.py's stand-in hub (the Hub's gated dialect, weights from a "CDN")."""
    from tests.unit import test_gated_models as gated

    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), h) for h in (gated.StandInHub, gated.StandInCDN)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    gated.StandInHub.seen, gated.StandInHub.cdn = [], f"http://127.0.0.1:{servers[1].server_port}"
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{servers[0].server_port}")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    yield gated
    for s in servers:
        s.shutdown()


def test_a_gated_model_is_read_with_the_users_token_and_only_its_config(gated_hub, monkeypatch):
    with pytest.raises(fit.FitError, match=r"org/gated is gated or private and no Hugging Face token was found"):
        fit.model_config("org/gated")
    monkeypatch.setenv("HF_TOKEN", gated_hub.GOOD)
    with pytest.raises(fit.FitError) as info:  # the stand-in's config.json has only model_type
        fit.model_config("org/gated")
    assert str(info.value).startswith("model org/gated: config.json field 'hidden_size' is None")
    assert [(where, path) for where, path, _auth in gated_hub.StandInHub.seen] == \
        [("hub", "/org/gated/resolve/main/config.json")] * 2  # config.json alone, never the weights
    assert gated_hub.StandInHub.seen[1][2] == f"Bearer {gated_hub.GOOD}"


# ---------------------------------------------------------------- the stand-in hub and `fab train`


class ConfigHub(http.server.BaseHTTPRequestHandler):
    """The Hub's file URL for config.json alone ({repo}/resolve/{revision}/config.json) of the Qwen3 fixtures
    (tests/unit/test_gated_models.py's stand-in has the gated dialect, used above)."""

    files: dict[str, bytes] = {}
    seen: list[str] = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        ConfigHub.seen.append(self.path)
        repo, _, rest = self.path.partition("/resolve/")
        repo = repo.lstrip("/")
        if rest == "main/config.json" and repo in self.files:
            status, body = 200, self.files[repo]
        else:
            status, body = 404, b""
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def hub(monkeypatch, tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ConfigHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ConfigHub.files = {f"Qwen/Qwen3-{s}": (CONFIGS / f"Qwen3-{s}.json").read_bytes() for s in SIZES}
    ConfigHub.seen = []
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    yield ConfigHub
    server.shutdown()


class HostTouched(AssertionError):
    pass


@pytest.fixture
def aws_inventory(monkeypatch, tmp_path):
    """`fab train --target aws` on the default cluster (2 x 4 L4s) with no host: connecting is an error."""
    local = local_plan.make_inventory(2, 4)
    inv = dataclasses.replace(local, target="aws", access=dataclasses.replace(local.access, ssh_key_file=""),
                              facts=dataclasses.replace(local.facts, shape=dataclasses.replace(
                                  local.facts.shape, gpu_type="l4")))
    monkeypatch.setattr(finetune.targets, "load", lambda target, stack=None: inv)
    monkeypatch.setattr(runs, "RUNS", tmp_path)

    def connect(*_a, **_k):
        raise HostTouched("a host was contacted")
    monkeypatch.setattr(finetune, "connect", connect)


def unsharded_config(tmp_path, **more) -> str:
    path = tmp_path / "unsharded.yaml"
    path.write_text("".join(f"{k}: {v}\n" for k, v in {"sharding": "none", **more}.items()))
    return str(path)


def test_fab_train_refuses_a_run_that_cannot_fit_before_touching_a_host(hub, aws_inventory, capsys, tmp_path):
    with pytest.raises(Exit) as info:
        fabfile.train(Context(config=Config()), target="aws", stack="dev", model="Qwen/Qwen3-14B",
                      config=unsharded_config(tmp_path))
    msg = str(info.value.message)
    assert info.value.code == 1 and msg.startswith("fab train: Qwen/Qwen3-14B does not fit one L4 of g6.12xlarge: ")
    peak = re.search(r"predicted peak (\d+\.\d) GiB per GPU > 22\.5 GiB", msg)
    assert peak and float(peak.group(1)) > 28 and "sharding: fsdp (the base sharded 8-way" in msg, msg  # 27.5 GiB
    assert "or a type with bigger GPUs: p4d.24xlarge" in msg  # the smallest that fits
    assert hub.seen == ["/Qwen/Qwen3-14B/resolve/main/config.json"]  # config.json alone: no weights
    # a model that fits goes on to the cluster (here: the connection, which the fixture refuses)
    with pytest.raises(HostTouched):
        fabfile.train(Context(config=Config()), target="aws", stack="dev", model="Qwen/Qwen3-4B")
    assert "fits with" in capsys.readouterr().out


def test_fab_train_refuses_an_unreadable_config_before_touching_a_host(hub, aws_inventory):
    with pytest.raises(Exit) as info:
        fabfile.train(Context(config=Config()), target="aws", stack="dev", model="org/none")
    assert "org/none: its config.json" in str(info.value.message) and "check the model ID" in str(info.value.message)


def test_fab_estimate_prints_the_verdict_and_the_change(hub, capsys, tmp_path):
    fabfile.estimate(Context(config=Config()), target="aws", stack="dev", model="Qwen/Qwen3-8B")
    out = capsys.readouterr().out
    assert "fit: Qwen/Qwen3-8B on L4 (g6.12xlarge, 22.5 GiB): predicted peak" in out and "fits with" in out
    fabfile.estimate(Context(config=Config()), target="aws", stack="dev", model="Qwen/Qwen3-32B", model_gb="65.5",
                     config=unsharded_config(tmp_path))
    out = capsys.readouterr().out
    peak = fit.check(qwen3("32B"), setting_with(sharding="none"), "g6.12xlarge", 8).peak  # 2 nodes x 4 L4s: 8 ranks
    assert f"fit: Qwen/Qwen3-32B on L4 (g6.12xlarge, 22.5 GiB): predicted peak {peak / GIB:.1f} GiB per GPU: " \
        "does NOT fit" in out
    assert "cheapest change that fits: sharding: fsdp (the base sharded 8-way" in out
    # the default (sharding auto) shards it and says so
    fabfile.estimate(Context(config=Config()), target="aws", stack="dev", model="Qwen/Qwen3-32B", model_gb="65.5")
    out = capsys.readouterr().out
    assert "fits with" in out and "sharding auto: the base sharded 8-way" in out
    assert "cost, new stack" in out  # the time and cost still printed


def test_fab_train_refuses_sharding_with_one_rank_before_touching_a_host(hub, aws_inventory, tmp_path):
    path = tmp_path / "fsdp.yaml"
    path.write_text("sharding: fsdp\n")
    with pytest.raises(Exit) as info:
        fabfile.train(Context(config=Config()), target="aws", stack="dev", model="Qwen/Qwen3-4B", config=str(path),
                      nodes="1", gpus_per_node="1")
    assert info.value.code == 1 and str(info.value.message).startswith(
        "fab train: sharding: fsdp needs 2 or more ranks to shard over; this run has 1"), info.value.message


def test_the_local_cluster_refuses_sharding_with_one_rank(tmp_path):
    from ops.cost import estimate as est

    path = tmp_path / "fsdp.yaml"
    path.write_text("sharding: fsdp\n")
    opts = options.parse(target="local", config=str(path), nodes="1", gpus_per_node="1", model="/scratch/tiny/model",
                         data="/scratch/tiny/data/train.jsonl")
    cluster = est.for_run(opts, None).cluster
    with pytest.raises(fit.FitError, match="sharding: fsdp needs 2 or more ranks"):
        fit.report(opts, cluster)


def test_the_local_cluster_reports_and_never_refuses(capsys):
    opts = options.parse(target="local")
    from ops.cost import estimate as est

    cluster = est.for_run(opts, None).cluster
    assert fit.report(opts, cluster) is None
    assert "the local cluster trains on CPU" in capsys.readouterr().out


def test_the_default_lora_targets_are_args_pys_own():
    """lora_target_modules' default comes from a default_factory: the settings schema must give it, or the fit
    check would count no adapters at all."""
    from training.args import ModelArguments

    assert default("lora_target_modules") == ModelArguments().lora_target_modules
    v = fit.check(qwen3("4B"), default, "g6.12xlarge", 8)
    assert v.plan.lora_targets == ("q_proj", "k_proj", "v_proj", "o_proj") and v.terms["lora_state"] > 0


def test_a_model_on_the_cluster_is_read_on_the_controller(tmp_path):
    """A path on the cluster: its config.json read through the controller's connection (ops/ssh/remote.py
    read_text); here an invoke Context, which runs the same `cat` on this machine."""
    import invoke

    controller = Context(config=invoke.Config(overrides={"run": {"in_stream": False}}))
    model = tmp_path / "qwen3-14b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(qwen3("14B")))
    assert fit.model_config(str(model), controller) == qwen3("14B")
    with pytest.raises(fit.FitError, match=r"no readable config.json there \(checked on the controller\)"):
        fit.model_config(str(tmp_path / "nothing"), controller)
    (model / "config.json").write_text("{")
    with pytest.raises(fit.FitError, match=r"its config.json is not JSON"):
        fit.model_config(str(model), controller)


def test_changes_add_up_when_one_alone_does_not_fit():
    """Recomputation alone is not enough for 8 padded rows of 4,096 tokens of Qwen3-8B on an L4: the advice
    keeps it and adds the smaller micro-batch (and shorter rows) until the peak fits."""
    setting = setting_with(flex_packing="false", per_device_train_batch_size=8, gradient_accumulation_steps=2,
                           max_length=4096, activation_checkpointing="false", sharding="none")
    v = fit.check(qwen3("8B"), setting, "g6.12xlarge", 8)
    alone = mm.peak_bytes(qwen3("8B"), dataclasses.replace(v.plan, checkpointing=True))
    assert not v.fits and alone > v.usable
    assert v.change.what.startswith("activation_checkpointing: true, per_device_train_batch")
    assert v.change_peak <= v.usable and v.change.plan.checkpointing


def test_a_benchmark_gets_the_terms_from_one_call():
    terms = mm.predict(qwen3("4B"), {"max_length": 2048, "flex_packing": "false", "per_device_train_batch_size": 4})
    plan = mm.plan_from_settings(setting_with(max_length=2048, flex_packing="false", per_device_train_batch_size=4), 1)
    assert plan.tokens == 4 * 2048 and plan.checkpointing  # padded rows, recomputed (activation_checkpointing auto)
    assert terms == mm.breakdown(qwen3("4B"), plan) and set(terms) == {"base_weights", "lora_state", "activations",
                                                                       "loss_head", "runtime"}


@pytest.mark.parametrize("kind", ["eager", "compiled", "checkpointed"])
def test_predictions_are_within_a_tenth_of_the_peaks_measured_on_an_h100(kind):
    """The recorded H100 runs (benchmarks/bench_memory.py; BENCHMARKS.md "Memory model"): each case's prediction
    from its own settings, against its measured footprint (reserved peak + what CUDA holds outside torch's
    allocator) and allocated peak. A change to the model that moves it off what was measured fails here."""
    results = json.loads((REPO / "benchmarks" / "results" / f"memory-{kind}-h100-2026-12-07.json").read_text())
    assert "H100" in results["gpu"] and len(results["cases"]) == 8
    for case in results["cases"]:
        terms = mm.predict(qwen3(case["model"].removeprefix("Qwen3-")), case["settings"])
        peak = sum(terms.values()) / mm.GIB
        allocated = (sum(terms.values()) - terms["runtime"]) / mm.GIB
        assert abs(peak / case["footprint_peak_gib"] - 1) <= 0.10, (case["model"], case["length"], peak)
        assert abs(allocated / case["allocated_peak_gib"] - 1) <= 0.05, (case["model"], case["length"], allocated)
