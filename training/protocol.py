"""The job protocol: the tagged log lines and the marker files by which a job and `fab train` talk.

One definition for the three sides that speak it: training/ (rank 0 prints the tags, writes the markers),
the job templates in jobs/ (rendered with `template_context()`: no name is spelled in a template) and
ops/ (ops/finetune/joblog.py and timeline.py parse the tags; stack_down and pipeline look for COMPLETED).

It lives in training/ because training/ is the lowest layer ops/ may import (tests/unit/test_import_graph.py)
and the only one that reaches the GPU nodes: `fab train` ships training/ into each job's directory, so
the batch script's `python -m training.requeue` and the ranks import this very file. Standard library
only, nothing at all in fact: it is imported beside every rank and by the batch script.

A tag counts only at the start of a line (after srun -l's "N: " and torchrun's "[default0]:" prefixes,
see ops/finetune/joblog.py), followed by one space and a JSON object.
"""

from __future__ import annotations

# Tags: `TAG {json}` lines in the job's log.
JOB = "SLURM_GPU_JOB"  # the batch script starting (again, after a requeue: restart > 0); "t": epoch seconds
LOG = "SLURM_GPU_LOG"  # rank 0, one per logged optimizer step
RESUMED = "SLURM_GPU_RESUMED"  # rank 0 resumed from a checkpoint
METRICS = "SLURM_GPU_METRICS"  # rank 0's final metrics (or the batch script's, from COMPLETED, on a requeue)
SPOT = "SLURM_GPU_SPOT"  # rank 0 checkpointed on the spot watcher's signal
HANG = "SLURM_GPU_HANG"  # the batch script: the hang watchdog's report
END = "SLURM_GPU_END"  # the batch script ending; "t": epoch seconds
TAGS = (JOB, LOG, RESUMED, METRICS, SPOT, HANG, END)

# Markers: files in the run's output_dir.
COMPLETED = "COMPLETED"  # training finished: written after the adapters and metrics (first line: the metrics)
INTERRUPTED = "INTERRUPTED"  # rank 0 checkpointed after a spot notice: the batch script requeues
HUNG = "HUNG"  # the hang watchdog ended a stuck rank: the batch script reports and requeues
SPOT_REQUEUES = "SPOT_REQUEUES"  # the batch script: one line per spot requeue (they do not count as failures)
MARKERS = (COMPLETED, INTERRUPTED, HUNG, SPOT_REQUEUES)


def prefix(tag: str) -> str:
    """`tag` as a line starts with it: the tag and one space."""
    if tag not in TAGS:
        raise ValueError(f"unknown job protocol tag {tag!r} (known: {', '.join(TAGS)})")
    return tag + " "


def template_context() -> dict[str, dict[str, str]]:
    """What the job templates get: `tags.JOB` -> "SLURM_GPU_JOB", `markers.COMPLETED` -> "COMPLETED"."""
    return {"tags": {name: globals()[name] for name in ("JOB", "LOG", "RESUMED", "METRICS", "SPOT", "HANG", "END")},
            "markers": {name: name for name in MARKERS}}
