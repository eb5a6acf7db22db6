"""The cost cap during a run (`fab train --max-cost`): stop with a checkpoint before the cap is passed.

After each optimizer step rank 0 projects what the run will have cost once one more step and a
checkpoint are done: the hourly rate of the job's instances (`cost_per_hour_usd`) times the wall time
since the run began costing (`cost_started_at`, fab's start on the cluster's clock: the steps before
training count), plus the measured step time, checkpoint time and the run's tail after training (the
held-out evaluation, samples and adapters: as long as the evaluation and samples before training took,
`tail_s`). When that would pass `max_cost_usd`
it asks the Trainer to save a checkpoint now and stop; every rank gets the decision from rank 0 (a
broadcast), so all stop at the same step. The run then ends as a finished one (adapters, metrics,
COMPLETED marker: a requeue does not train again), and metrics.json says `stopped_by: max_cost` with
what was spent and what the full run would have cost.
"""

from __future__ import annotations

import time

from transformers import TrainerCallback

STOPPED_BY = "max_cost"


# ---------------------------------------------------------------- the arithmetic


def cost_at(t: float, started_at: float, per_hour: float) -> float:
    """US dollars spent from `started_at` until `t` (Unix seconds) at `per_hour`."""
    return per_hour * max(0.0, t - started_at) / 3600


def step_seconds(train_begin: float, step_ends: tuple[float, float], steps_done: int) -> float:
    """The measured time of one optimizer step: the mean since the first step ended (the first one's
    warm-up and compile excluded) once there are two, else the first step's own time (an overestimate)."""
    first_end, last_end = step_ends
    if steps_done >= 2 and last_end > first_end:
        return (last_end - first_end) / (steps_done - 1)
    return max(0.0, first_end - train_begin)


def would_pass(now: float, step_s: float, margin_s: float, started_at: float, per_hour: float, cap: float) -> bool:
    """Whether one more step and then `margin_s` (a checkpoint, the run's end) would end above the cap."""
    return cost_at(now + step_s + margin_s, started_at, per_hour) > cap


def full_run_cost(spent: float, steps_left: int, step_s: float, per_hour: float) -> float:
    """What the run would have cost had it trained to the end: what it spent plus the steps it did not take."""
    return spent + per_hour * max(0, steps_left) * step_s / 3600


# ---------------------------------------------------------------- the callback


def _rank0_decides(stop: bool, group) -> bool:
    """Rank 0's decision on every rank (CPU tensors over gloo: no wait on the GPU)."""
    import torch
    import torch.distributed as dist

    if group is None:
        return stop
    flag = torch.tensor([int(stop)], dtype=torch.int32)
    dist.broadcast(flag, src=0, group=group)
    return bool(flag.item())


class CostCapCallback(TrainerCallback):
    """See the module docstring. `clock`: time.time, replaceable in tests."""

    def __init__(self, max_cost_usd: float, per_hour: float, started_at: float, clock=time.time):
        self.cap, self.per_hour, self.started_at, self.clock = max_cost_usd, per_hour, started_at, clock
        self.train_begin: float | None = None
        self.first_end: float | None = None
        self.last_end: float | None = None
        self.steps = 0  # optimizer steps taken by this process (a resumed run starts again at 0)
        self.save_s: float | None = None  # the last checkpoint's time in the loop
        self.tail_s = 0.0  # what the run does after training (training/train.py sets it)
        self.step_s = 0.0
        self.stopped_at: int | None = None
        self.max_steps = 0
        self.group = None

    def on_train_begin(self, args, state, control, **kwargs):
        import torch.distributed as dist

        self.train_begin = self.clock()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # Every rank makes the group here (a collective); gloo keeps the flag off the GPU's stream.
            self.group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD

    def on_train_end(self, args, state, control, **kwargs):
        self.group = None  # no reference left to keep the group's threads alive (train.teardown_process_group)

    def on_step_end(self, args, state, control, **kwargs):
        # transformers/trainer.py, _inner_training_loop: on_step_end runs before _maybe_log_save_evaluate
        # (which saves when control.should_save) and the loop breaks after it on should_training_stop.
        now = self.clock()
        self.steps += 1
        self.first_end = self.first_end or now
        self.last_end, self.max_steps = now, state.max_steps
        if state.max_steps and state.global_step >= state.max_steps:
            return control  # the last step: the run ends anyway
        stop = False
        if state.is_world_process_zero:
            self.step_s = step_seconds(self.train_begin or now, (self.first_end, now), self.steps)
            save_s = self.save_s if self.save_s is not None else self.step_s  # no checkpoint yet: a step's time
            stop = would_pass(now, self.step_s, save_s + self.tail_s, self.started_at, self.per_hour, self.cap)
        if _rank0_decides(stop, self.group):
            self.stopped_at = state.global_step
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_save(self, args, state, control, **kwargs):
        if self.last_end is not None:
            self.save_s = self.clock() - self.last_end
        return control

    def report(self) -> dict:
        """metrics.json's keys: `cost` always, `stopped_by` when the cap stopped the run (rank 0)."""
        spent = cost_at(self.clock(), self.started_at, self.per_hour)
        cost = {"max_usd": self.cap, "per_hour_usd": self.per_hour, "spent_usd": round(spent, 4),
                "step_s": round(self.step_s, 4), "max_steps": self.max_steps}
        if self.stopped_at is None:
            return {"cost": cost}
        cost["stopped_at_step"] = self.stopped_at
        cost["full_run_usd"] = round(full_run_cost(spent, self.max_steps - self.stopped_at, self.step_s,
                                                   self.per_hour), 4)
        return {"stopped_by": STOPPED_BY, "cost": cost}


def make(train_args) -> CostCapCallback | None:
    """The callback when the run has a cap (`max_cost_usd` > 0), else None."""
    if not getattr(train_args, "max_cost_usd", 0):
        return None
    return CostCapCallback(train_args.max_cost_usd, train_args.cost_per_hour_usd, train_args.cost_started_at)
