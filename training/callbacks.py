"""The Trainer callbacks of a run: progress lines for `fab train`, phase timing, the last checkpoint, faults."""

from __future__ import annotations

import json
import os
import time

from transformers import TrainerCallback

from training import protocol

LOG_PREFIX = protocol.prefix(protocol.LOG)
# Test-only fault injection: the rank SLURM_GPU_FAULT_RANK raises after optimizer step SLURM_GPU_FAULT_STEP.
FAULT_RANK_ENV = "SLURM_GPU_FAULT_RANK"
FAULT_STEP_ENV = "SLURM_GPU_FAULT_STEP"


class StepLogCallback(TrainerCallback):
    """One JSON line per logged step on rank 0, for `fab train`'s progress display."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            line = {"step": state.global_step, "max_steps": state.max_steps, **logs}
            print(LOG_PREFIX + json.dumps(line), flush=True)


class FaultInjectionCallback(TrainerCallback):
    """Test-only: make one rank crash after a given optimizer step (proves the job fails fast)."""

    def __init__(self, rank: int, step: int):
        self.rank, self.step = rank, step

    def on_step_end(self, args, state, control, **kwargs):
        if int(os.environ.get("RANK", "0")) == self.rank and state.global_step == self.step:
            raise RuntimeError(f"injected fault ({FAULT_RANK_ENV}={self.rank}, {FAULT_STEP_ENV}={self.step})")


class PhaseTimingCallback(TrainerCallback):
    """Where a run's training time goes, for metrics.json and time-to-adapters: the host's clock at the start
    of training and at the end of the first optimizer step (compile, CUDA, kernel and allocator warm-up
    included), and each checkpoint's wall time in the loop: from a saving step's end until training may go
    on (the queued step finishing on the GPU, its log, and the files, or with background checkpoints a copy
    of the state). `phases` (training.phases.RankPhases) gets first_step, steps and each checkpoint."""

    def __init__(self, phases=None):
        self.phases = phases
        self.train_begin: float | None = None
        self.first_step_end: float | None = None
        self.checkpoint_s = 0.0
        self.checkpoints = 0
        self._step_end: float | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.train_begin = time.time()

    def on_step_end(self, args, state, control, **kwargs):
        self._step_end = time.time()
        if self.first_step_end is None:
            self.first_step_end = self._step_end
            if self.phases is not None and self.train_begin is not None:
                self.phases.add("first_step", self.train_begin, self._step_end)

    def on_save(self, args, state, control, **kwargs):
        if self._step_end is not None:
            now = time.time()
            self.checkpoint_s += now - self._step_end
            self.checkpoints += 1
            if self.phases is not None:
                self.phases.add("checkpoint", self._step_end, now, step=state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self.phases is not None and self.first_step_end is not None:
            self.phases.add("steps", self.first_step_end, time.time())


class NoFinalCheckpointCallback(TrainerCallback):
    """Drop the checkpoint the Trainer schedules at the last step (final_checkpoint=false): the adapters and
    trainer state follow at once in output_dir. Runs after the Trainer's own flow callback, which sets it."""

    def on_step_end(self, args, state, control, **kwargs):
        return self._drop_at_end(state, control)

    def on_epoch_end(self, args, state, control, **kwargs):
        return self._drop_at_end(state, control)

    @staticmethod
    def _drop_at_end(state, control):
        if state.max_steps and state.global_step >= state.max_steps:
            control.should_save = False
        return control


def make_callbacks(final_checkpoint: bool) -> list[TrainerCallback]:
    callbacks: list[TrainerCallback] = [StepLogCallback()]
    if not final_checkpoint:
        callbacks.append(NoFinalCheckpointCallback())
    if os.environ.get(FAULT_RANK_ENV) and os.environ.get(FAULT_STEP_ENV):
        callbacks.append(FaultInjectionCallback(int(os.environ[FAULT_RANK_ENV]), int(os.environ[FAULT_STEP_ENV])))
    return callbacks
