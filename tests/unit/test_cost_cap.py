"""`fab train --max-cost`: the projection a run stops on, and the refusal before launch (no host touched).

The run on the local cluster that the cap cuts short is tests/cluster/test_cost_cap_cluster.py.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time

import pytest
from fabric import Config
from invoke import Context
from invoke.exceptions import Exit
from transformers import TrainerControl, TrainerState

import fabfile
from localcluster import plan
from ops.actions import options
from ops.cost import cap as cost_cap
from ops.cost import estimate as est
from ops.finetune import pipeline as finetune
from ops.finetune import runs, summary
from ops.finetune.joblog import JobLog
from training import cost_cap as run_cap
from training.args import parse_args

# ---------------------------------------------------------------- the projection during the run


def test_cost_is_the_hourly_rate_over_the_wall_time_since_the_run_began():
    assert run_cap.cost_at(1000 + 1800, 1000, 7.2) == pytest.approx(3.6)
    assert run_cap.cost_at(900, 1000, 7.2) == 0.0  # a clock a little behind fab's start spends nothing
    # the first step's time stands in until a second step gives a rate without the warm-up
    assert run_cap.step_seconds(10.0, (40.0, 40.0), 1) == pytest.approx(30.0)
    assert run_cap.step_seconds(10.0, (40.0, 52.0), 5) == pytest.approx(3.0)
    assert run_cap.would_pass(100, 3, 2, 0, 36.0, cap=1.04) is True  # 105 s at $0.01/s: $1.05
    assert run_cap.would_pass(100, 3, 2, 0, 36.0, cap=1.06) is False
    assert run_cap.full_run_cost(2.0, 10, 3.0, 36.0) == pytest.approx(2.3)


class FakeClock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


# (cap, step time, checkpoint time, tail after training): stops before the first checkpoint, after one,
# with a long tail, and a run that fits.
CASES = [(0.21, 1.0, 0.5, 0.0), (0.4, 1.5, 3.0, 0.0), (0.4, 0.5, 0.25, 6.0), (1.0, 0.5, 0.0, 0.0)]


@pytest.mark.parametrize("cap,step_s,save_s,tail_s", CASES)
def test_callback_stops_with_a_checkpoint_at_the_last_step_that_stays_under_the_cap(cap, step_s, save_s, tail_s):
    """100 steps at a steady step time (the first 4 s: warm-up), a checkpoint every 10, $36/h ($0.01/s), 5 s
    spent before training: rank 0 asks for a checkpoint and a stop at the last step after which one more
    step, a checkpoint and the run's tail would pass the cap; what the run spent stays under it."""
    per_h, max_steps, first_step_s, save_every = 36.0, 100, 4.0, 10
    clock = FakeClock(5.0)
    cb = run_cap.CostCapCallback(cap, per_h, 0.0, clock=clock)
    cb.tail_s = tail_s
    state, control = TrainerState(), TrainerControl()
    state.max_steps, state.is_world_process_zero = max_steps, True
    cb.on_train_begin(None, state, control)
    clock.t += first_step_s
    stopped, ends, saved = None, [], False
    for step in range(1, max_steps + 1):
        state.global_step = step
        ends.append(clock.t)
        control = cb.on_step_end(None, state, control)
        if control.should_training_stop:
            stopped = step
            assert control.should_save, "the stop must save a checkpoint"
        if control.should_save or step % save_every == 0:
            saved = saved or not stopped
            clock.t += save_s
            cb.on_save(None, state, control)
            control.should_save = False
        if stopped:
            break
        clock.t += step_s
    stop_end = clock.t
    clock.t += tail_s  # evaluation, samples, adapters
    report = cb.report()
    per_s = per_h / 3600
    assert report["cost"]["spent_usd"] == pytest.approx(clock.t * per_s, abs=1e-4)
    assert clock.t * per_s <= cap + 1e-9  # the cap held
    if stopped is None:  # the whole run fits: no marker
        assert "stopped_by" not in report
        return
    assert 1 < stopped < max_steps
    # the measured step time: the mean since the first step (periodic checkpoints included), and one more
    # step, a checkpoint (as long as the last one, else a step) and the tail would have passed the cap
    measured = (ends[-1] - ends[0]) / (len(ends) - 1)
    assert step_s <= measured < step_s + save_s + 1e-9
    assert (ends[-1] + measured + (save_s if saved else measured) + tail_s) * per_s > cap
    assert stop_end == ends[-1] + save_s
    assert report["stopped_by"] == "max_cost"
    cost = report["cost"]
    assert cost["stopped_at_step"] == stopped and cost["max_steps"] == max_steps and cost["max_usd"] == cap
    assert cost["full_run_usd"] == pytest.approx((clock.t + (max_steps - stopped) * measured) * per_s, abs=1e-4)
    assert cost["full_run_usd"] > cap


def test_no_stop_on_the_last_step_and_no_callback_without_a_cap():
    cb = run_cap.CostCapCallback(0.001, 36.0, 0.0, clock=FakeClock(1000.0))
    state, control = TrainerState(), TrainerControl()
    state.max_steps, state.global_step, state.is_world_process_zero = 3, 3, True
    cb.on_train_begin(None, state, control)
    assert not cb.on_step_end(None, state, control).should_training_stop  # the run ends there anyway
    _, _, no_cap = parse_args([])
    assert run_cap.make(no_cap) is None
    _, _, capped = parse_args(["--max_cost_usd", "2.5", "--cost_per_hour_usd", "7.2", "--cost_started_at", "100"])
    made = run_cap.make(capped)
    assert (made.cap, made.per_hour, made.started_at) == (2.5, 7.2, 100.0)
    with pytest.raises(ValueError, match="max_cost_usd must be 0 .* cost_per_hour_usd > 0"):
        parse_args(["--max_cost_usd", "2.5"])


def test_summary_says_the_cap_stopped_the_run_and_what_the_full_run_would_cost():
    cost = {"max_usd": 0.1, "per_hour_usd": 7.2, "spent_usd": 0.0981, "step_s": 0.4, "max_steps": 24,
            "stopped_at_step": 9, "full_run_usd": 0.1101}
    run = summary.RunSummary("7", "", {"train_steps": 9, "stopped_by": "max_cost", "cost": cost}, [],
                             summary.nccl.parse([]))
    text = "\n".join(run.lines())
    assert re.search(r"cost cap\s+stopped by --max-cost \$0\.10 at step 9 of 24 \(checkpoint saved", text), text
    assert "$0.10 spent; the full run would have cost ~$0.11" in text
    under = summary.RunSummary("8", "", {"cost": {**cost, "stopped_at_step": None}}, [], summary.nccl.parse([]))
    assert "finished under the cap" in "\n".join(under.lines())
    assert "cost cap" not in "\n".join(summary.RunSummary("9", "", {}, [], summary.nccl.parse([])).lines())
    assert summary.build("7", "", JobLog(), None).cost_lines() == []


# ---------------------------------------------------------------- before launch


def _aws_run(examples: int) -> est.Estimate:
    return est.for_run(options.parse(target="aws", stack="dev", examples=str(examples)), None)


def test_aws_refusal_says_by_how_much_and_the_rows_that_fit():
    e = _aws_run(52000)
    cost = cost_cap.run_cost(e, "first")
    assert cost == pytest.approx(sum(c.usd for c in est.cost(e, "first")))
    cap = round(cost / 2, 2)
    with pytest.raises(cost_cap.CostCapError) as info:
        cost_cap.check_before_launch(e, "first", cap)
    msg = str(info.value)
    assert f"--max-cost ${cap:.2f}: the run is estimated at ${cost:.2f}" in msg
    assert f"${cost - cap:.2f} over the cap" in msg
    low, high = est.spot_bill(e, "first")
    assert f"GPU nodes on spot (slurm-gpu:gpuMarket spot): ${low:.2f}-${high:.2f}" in msg, msg
    assert ("fits" if high <= cap else "may fit" if low <= cap else "does not fit either") in msg
    assert "Nothing was started" in msg
    rows = int(re.search(r"fewer rows: --examples (\d+) \(of 52,000\)", msg)[1])

    def at(n: int) -> float:
        return cost_cap.run_cost(est.estimate(e.cluster, dataclasses.replace(e.job, rows=n)), "first")
    assert at(rows) <= cap < at(rows + 1)  # the most rows that fit
    assert cost_cap.check_before_launch(e, "first", cost + 0.01) == pytest.approx(cost)  # fits: no error


def test_aws_refusal_names_fewer_nodes_when_a_smaller_stack_fits():
    e = _aws_run(52000)
    one = cost_cap.run_cost(est.estimate(dataclasses.replace(e.cluster, nodes=1, stack_nodes=1), e.job), "first")
    two = cost_cap.run_cost(e, "first")
    assert one < two
    with pytest.raises(cost_cap.CostCapError, match=r"fewer nodes: --nodes 1 on a stack of 1 \(slurm-gpu:gpuNodeCount\)"):
        cost_cap.check_before_launch(e, "first", (one + two) / 2)


def test_a_spot_stack_is_capped_at_the_high_end_of_its_spot_range():
    """On a spot stack the cap prices the GPU nodes at the recorded range's high end, before launch
    and during the run, and does not suggest spot again."""
    od = _aws_run(52000)
    spot = est.estimate(dataclasses.replace(od.cluster, market="spot"), od.job)
    low, high = est.spot_bill(spot, "first")
    assert cost_cap.run_cost(spot, "first") == pytest.approx(high) and high < cost_cap.run_cost(od, "first")
    rng = cost_cap._spot(spot.cluster)
    assert cost_cap.gpu_rate_per_h(spot.cluster) == rng.high
    assert cost_cap.rate_per_h(od.cluster) - cost_cap.rate_per_h(spot.cluster) == pytest.approx(
        od.cluster.billed_nodes * (est.price_per_h(od.cluster.region, od.cluster.gpu_type) - rng.high))
    with pytest.raises(cost_cap.CostCapError) as info:
        cost_cap.check_before_launch(spot, "first", round(high / 2, 2))
    assert "on spot" not in str(info.value) and f"estimated at ${high:.2f}" in str(info.value)


def test_rate_per_hour_is_the_estimates_bill_per_hour():
    e = _aws_run(2000)
    wall_h = e.total("again") / 3600
    bill = sum(c.usd for c in est.cost(e, "again"))  # NAT GB charges: none in "again"
    assert cost_cap.rate_per_h(e.cluster) * wall_h == pytest.approx(bill, rel=1e-9)
    local = est.for_run(options.parse(target="local"), None)
    price = json.loads((est.DATA / "local.json").read_text())["standin_price_per_node_h"]
    assert cost_cap.rate_per_h(local.cluster) == pytest.approx(2 * price)


class HostTouched(AssertionError):
    pass


@pytest.fixture
def local_inventory(monkeypatch, tmp_path):
    """`fab train --target local` with a 2 x 2 inventory and no cluster: connecting is an error."""
    monkeypatch.setattr(finetune.targets, "load", lambda target, stack=None: plan.make_inventory(2, 2))
    monkeypatch.setattr(runs, "RUNS", tmp_path)

    def connect(*_a, **_k):
        raise HostTouched("a host was contacted")
    monkeypatch.setattr(finetune, "connect", connect)


def test_local_run_over_the_cap_is_refused_before_any_host(local_inventory):
    e = est.for_run(options.parse(target="local"), None)
    price = json.loads((est.DATA / "local.json").read_text())["standin_price_per_node_h"]
    cost = 2 * price * e.total("first") / 3600
    with pytest.raises(Exit) as info:
        fabfile.train(Context(config=Config()), target="local", max_cost="0.01")
    msg = str(info.value.message)
    assert info.value.code == 1
    assert msg.startswith("fab train: --max-cost $0.01: the run is estimated at ") and f"${cost:.2f}" in msg, msg
    assert f"${cost - 0.01:.2f} over the cap" in msg and "stand-in price" in msg and "Nothing was started" in msg
    # a cap the estimate fits goes on to the cluster (here: the connection, which the fixture refuses)
    with pytest.raises(HostTouched):
        fabfile.train(Context(config=Config()), target="local", max_cost=f"{cost + 1:.2f}")


def test_estimate_with_a_cap_says_whether_it_fits(capsys):
    with pytest.raises(Exit, match="over the cap"):
        fabfile.train(Context(config=Config()), target="local", estimate=True, max_cost="0.001")
    fabfile.train(Context(config=Config()), target="local", estimate=True, max_cost="100")
    assert re.search(r"fits --max-cost \$100\.00: estimated at \$\d+\.\d\d", capsys.readouterr().out)


# ---------------------------------------------------------------- the Trainer stops (CPU, the tiny model)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.unit.test_training_run import N_EXAMPLES
    from training.make_tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny"), examples=N_EXAMPLES, seed=0)


def _capped(tiny, out, cap: float, *extra, per_hour: float = 1) -> list[str]:
    """A run that began costing at `per_hour` long enough ago to have spent $1 before its first step."""
    from tests.unit.test_training_run import argv_for

    return argv_for(tiny, out, "--max_cost_usd", str(cap), "--cost_per_hour_usd", str(per_hour),
                    "--cost_started_at", str(time.time() - 3600 / per_hour), *extra)


def test_a_run_over_its_cap_stops_after_the_first_step_with_a_checkpoint(tiny, tmp_path):
    from training import train

    out = tmp_path / "out"
    # At $3600/h a second costs $1: the steps the cap saved (milliseconds each on the tiny model) show in
    # metrics.json's 4 decimals. At $1/h they cost under $0.0001 and round to what was spent.
    metrics = train.main(_capped(tiny, out, 0.5, per_hour=3600))
    assert metrics["stopped_by"] == "max_cost" and metrics["train_steps"] == 1
    cost = metrics["cost"]
    assert cost["stopped_at_step"] == 1 < cost["max_steps"] and cost["full_run_usd"] > cost["spent_usd"] > 1.0
    state = json.loads((out / "checkpoint-1" / "trainer_state.json").read_text())
    assert state["global_step"] == 1 and (out / "checkpoint-1" / "adapter_model.safetensors").is_file()
    assert (out / "adapter_model.safetensors").is_file() and (out / "COMPLETED").is_file()
    assert json.loads((out / "COMPLETED").read_text())["stopped_by"] == "max_cost"


def test_a_run_under_its_cap_trains_to_the_end(tiny, tmp_path):
    from training import train

    metrics = train.main(_capped(tiny, tmp_path / "out", 1000, "--max_steps", "3"))
    assert "stopped_by" not in metrics and metrics["train_steps"] == 3
    assert 1.0 < metrics["cost"]["spent_usd"] < 1000


@pytest.mark.slow
def test_two_ranks_stop_together_on_rank_0s_word(tiny, tmp_path):
    from tests.unit.test_training_run import ABORT, torchrun

    out = tmp_path / "out"
    proc = torchrun(tiny, out, "--max_cost_usd", "0.5", "--cost_per_hour_usd", "1",
                    "--cost_started_at", str(time.time() - 3600))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["stopped_by"] == "max_cost" and metrics["train_steps"] == 1
    assert (out / "checkpoint-1" / "trainer_state.json").is_file()
    assert ABORT not in proc.stderr, proc.stderr[-3000:]
