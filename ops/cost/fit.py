"""Does the run fit each GPU's memory? Checked before launch, from the model's config.json and the run's settings.

The prediction is training/memory_model.py's (docs/MEMORY.md); this module gathers its inputs without starting a
node: the model's config.json (from the Hub through ops/actions/prefetch.py's reader and token, only that file,
or from the cluster path on the controller), the training settings `fab train` already checked
(TrainOptions.settings, args.py's defaults beneath), the run's ranks and its instance type's GPU memory
(ops/data/instances.json). `fab estimate` prints the verdict; `fab train` refuses a run that cannot fit on GPUs,
naming the numbers and the cheapest change that would fit. The local cluster trains on CPU: nothing to fit, so
it reports and never refuses.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from cluster.errors import UserError
from ops.cost import estimate as est
from training import memory_model as mm

MIB, GIB = 2**20, 2**30


class FitError(UserError, ValueError):
    pass


def model_config(model: str, controller=None) -> dict:
    """The model's config.json: from the Hub (that file alone, the user's token as the fetch uses it) or, for an
    absolute path, from the cluster through `controller`. An unreadable one is a FitError naming the fix."""
    if model.startswith("/"):
        if controller is None:
            raise FitError(f"model {model}: a path on the cluster, whose config.json is read on the controller")
        from ops.ssh.remote import read_text

        text = read_text(controller, f"{model.rstrip('/')}/config.json")
        if text is None:
            raise FitError(f"model {model}: no readable config.json there (checked on the controller); give the "
                           "directory that `save_pretrained` wrote, or fix --model / model_name_or_path")
        try:
            config = json.loads(text)
        except ValueError as exc:
            raise FitError(f"model {model}: its config.json is not JSON ({exc}); replace it with the model's "
                           "own config.json") from None
    else:
        from ops.actions import prefetch

        try:
            config = prefetch.hub_config(model, token=prefetch.hub_token())
        except prefetch.PrefetchError as exc:
            raise FitError(f"the fit check needs the model's config.json: {exc}") from None
    if not isinstance(config, dict):
        raise FitError(f"model {model}: its config.json is not a JSON object; replace it with the model's own")
    try:
        mm.Shape.of(config)
    except mm.ModelConfigError as exc:
        raise FitError(f"model {model}: {exc}") from None
    return config


def settings_of(opts) -> Callable[[str], object]:
    """A training setting of the run: the config's value (already checked by `fab train`'s options), else its
    default in training/args.py."""
    from training.validate import default

    given = getattr(opts, "settings", None) or {}
    return lambda key: given[key] if key in given else default(key)


def gpu_memory(gpu_type: str) -> tuple[str, float]:
    """(GPU name, bytes of memory CUDA reports for one) of an instance type, from ops/data/instances.json."""
    facts = est.instance(gpu_type, "slurm-gpu:gpuInstanceType")
    gpus = est._json("instances.json")["gpus"]
    if not facts.get("gpu") or "memory_mib" not in gpus.get(facts["gpu"], {}):
        raise FitError(f"{gpu_type}: no GPU memory in ops/data/instances.json; add its GPU's memory_mib there")
    return facts["gpu"], gpus[facts["gpu"]]["memory_mib"] * MIB


@dataclass
class FitVerdict:
    fits: bool
    peak: float
    usable: float
    plan: mm.Plan
    terms: dict[str, float]
    gpu: str
    gpu_type: str
    change: mm.FitChange | None = None  # the cheapest settings change that fits, when it does not fit
    change_peak: float = 0.0
    bigger: list[tuple[str, float | None]] = field(default_factory=list)  # types it fits unchanged, $/h

    def lines(self, model: str) -> list[str]:
        head = (f"  fit: {model} on {self.gpu} ({self.gpu_type}, {self.usable / GIB:.1f} GiB): predicted peak "
                f"{self.peak / GIB:.1f} GiB per GPU")
        terms = ", ".join(f"{k} {v / GIB:.2f}" for k, v in self.terms.items())
        shape = (f"{self.plan.tokens} tokens a micro-batch, checkpointing {'on' if self.plan.checkpointing else 'off'}"
                 f", {self.plan.ranks} rank(s)" + (f", sharded {self.plan.shards}-way" if self.plan.shards > 1 else ""))
        out = [head + (f", fits with {(self.usable - self.peak) / GIB:.1f} GiB headroom "
                       f"({(self.usable - self.peak) / self.usable:.0%})" if self.fits else ": does NOT fit"),
               f"    {shape}; {'; '.join(self.plan.notes)}", f"    GiB: {terms} (docs/MEMORY.md)"]
        if not self.fits:
            out.extend(f"    {line}" for line in self.advice())
        return out

    def advice(self) -> list[str]:
        out = []
        if self.change is not None:
            out.append(f"cheapest change that fits: {self.change.what} (peak {self.change_peak / GIB:.1f} GiB)")
        if self.bigger:
            itype, price = self.bigger[0]
            cost = f"${price:.2f}/h" if price is not None else "no price for it in ops/data/prices.json here"
            out.append(f"{'or ' if out else ''}a type with bigger GPUs: {itype} ({cost}) fits unchanged "
                       "(`pulumi config set slurm-gpu:gpuInstanceType " + itype + "`)")
        if not out:
            sharded = (f"the base sharded {self.plan.ranks}-way with checkpointing" if self.plan.ranks > 1 else
                       "checkpointing or shorter rows (one rank: nothing to shard over)")
            out.append(f"nothing fits: not even {sharded}, nor a bigger GPU type known to ops/data/instances.json; "
                       "lower per_device_train_batch_size or max_length, or a smaller model")
        return out


def check(config: Mapping, setting: Callable[[str], object], gpu_type: str, ranks: int,
          region: str | None = None) -> FitVerdict:
    """The verdict for a run of these settings on `ranks` GPUs of `gpu_type`."""
    gpu, usable = gpu_memory(gpu_type)
    packed = str(setting("flex_packing")).lower() in ("auto", "true")
    try:  # what the run decides itself: recomputation and sharding under auto (memory_model.run_plan)
        plan = mm.run_plan(config, setting, ranks, usable, gpu=True)
    except mm.ShardingError as exc:
        raise FitError(str(exc)) from None
    except ValueError as exc:
        raise FitError(f"the fit check: {exc}") from None
    terms = mm.breakdown(config, plan)
    peak = sum(terms.values())
    verdict = FitVerdict(peak <= usable, peak, usable, plan, terms, gpu, gpu_type)
    if not verdict.fits:
        verdict.change = mm.fitting_change(config, plan, usable, setting, packed)
        verdict.change_peak = mm.peak_bytes(config, verdict.change.plan) if verdict.change else 0.0
        verdict.bigger = _bigger_types(gpu_type, peak, region)
    return verdict


def _bigger_types(gpu_type: str, peak: float, region: str | None) -> list[tuple[str, float | None]]:
    """Instance types whose GPU holds `peak`, cheapest first (on-demand $/h in `region`, where priced)."""
    out = []
    gpus = est._json("instances.json")["gpus"]
    for itype, facts in est._json("instances.json")["types"].items():
        mem = gpus.get(facts.get("gpu") or "", {}).get("memory_mib")
        if itype == gpu_type or not mem or mem * MIB < peak:
            continue
        try:
            price = est.price_per_h(region, itype) if region else None
        except est.EstimateError:  # no price for it in this region: still a type that would fit
            price = None
        out.append((itype, price, mem))
    return [(t, p) for t, p, _m in sorted(out, key=lambda t: (t[1] is None, t[1] or 0.0, t[2]))]


def report(opts, cluster: est.PricedCluster, controller=None, say=print) -> FitVerdict | None:
    """`fab estimate` and `fab train`: the verdict's lines for this run; None on the local cluster (CPU: nothing
    to fit). FitError when the model's config.json cannot be read."""
    refuse_one_rank_sharding(opts, cluster)
    if cluster.calibrated:
        say("  fit: the local cluster trains on CPU (float32, no GPU memory to fit): reported, never refused")
        return None
    model = opts.model_path or ""
    verdict = check(model_config(model, controller), settings_of(opts), cluster.gpu_type,
                    cluster.nodes * cluster.ranks_per_node, cluster.region)
    for line in verdict.lines(model):
        say(line)
    return verdict


def refuse_one_rank_sharding(opts, cluster: est.PricedCluster) -> None:
    """`sharding: fsdp` on a run of one rank has nothing to shard over: refused before launch, CPU or GPU."""
    ranks = cluster.nodes * cluster.ranks_per_node
    if str(settings_of(opts)("sharding")).lower() == "fsdp" and ranks < 2:
        raise FitError(mm.one_rank_refusal(ranks))


def estimate_report(opts, cluster: est.PricedCluster, say=print) -> FitVerdict | None:
    """`fab estimate`, `fab train --estimate`: the verdict, or why there is none (an estimate still prints)."""
    if (opts.model_path or "").startswith("/") and not cluster.calibrated:
        say(f"  fit: {opts.model_path} is on the cluster: `fab train` reads its config.json there and checks the "
            "fit before any node starts")
        return None
    try:
        return report(opts, cluster, say=say)
    except FitError as exc:
        say(f"  fit: not checked: {exc}")
        return None


def refuse_unless_fits(verdict: FitVerdict | None, model: str) -> None:
    """`fab train`: a run that cannot fit is refused, naming the numbers and the change."""
    if verdict is None or verdict.fits:
        return
    raise FitError(f"{model} does not fit one {verdict.gpu} of {verdict.gpu_type}: predicted peak "
                   f"{verdict.peak / GIB:.1f} GiB per GPU"
                   + (f" sharded {verdict.plan.shards}-way" if verdict.plan.shards > 1 else "")
                   + f" > {verdict.usable / GIB:.1f} GiB; "
                   + "; ".join(verdict.advice()) + " (nothing was started; `fab estimate` shows the terms)")
