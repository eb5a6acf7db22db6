"""The run's timeline (ops/finetune/timeline.py): fab's phases and the job's, contiguous, on one clock."""

import json

from ops.finetune import timeline
from ops.finetune.timeline import Phase, Timeline

T0 = 1_800_000_000.0


def _timeline(offset: float = 0.0) -> tuple[Timeline, Phase]:
    tl = Timeline(started=T0, clock_offset_s=offset)
    tl.phases += [Phase("setup", T0, T0 + 2, "fab"), Phase("keys", T0 + 2, T0 + 3, "fab"),
                  Phase("staging", T0 + 3.5, T0 + 5, "fab")]  # 0.5 s between keys and staging
    follow = Phase("queue", T0 + 5, T0 + 60, "fab")
    tl.phases.append(follow)
    tl.phases.append(Phase("download", T0 + 60, T0 + 62, "fab"))
    return tl, follow


def _job(offset: float) -> tuple[dict, str]:
    """metrics.json's timing and the log's stamps as a cluster whose clock is `offset` ahead writes them."""
    c = T0 + offset
    timing = {"args_parsed": c + 15, "data_ready": c + 17, "model_loaded": c + 25, "trainer_built": c + 26,
              "first_step_done": c + 30, "trained": c + 50, "adapters_written": c + 52}
    log = (f'0: noise\nSLURM_GPU_JOB {{"job_id": "4", "restart": 0, "t": {c + 7}}}\n'
           f'SLURM_GPU_END {{"t": {c + 58}}}\n')
    return {"timing": timing, "checkpoint_s": 1.5, "checkpoints_saved": 2}, log


def test_job_phases_fill_the_follow_span_in_order():
    for offset in (0.0, 37.25):  # a cluster clock ahead of this machine's is shifted back
        tl, follow = _timeline(offset)
        metrics, log = _job(offset)
        timeline.add_job(tl, follow, metrics, log)
        rows = tl.rows()
        keys = [r.key for r in rows]
        assert keys == ["setup", "keys", "gap", "staging", "queue", "startup", "data", "model", "build",
                        "first_step", "steps", "save", "exit", "seen", "download"], keys
        by = {r.key: r for r in rows}
        assert abs(by["queue"].seconds - 2) < 1e-6  # submit (T0+5) -> batch script start (T0+7)
        assert abs(by["startup"].seconds - 8) < 1e-6 and abs(by["model"].seconds - 8) < 1e-6
        assert abs(by["exit"].seconds - 6) < 1e-6 and abs(by["seen"].seconds - 2) < 1e-6
        assert "1.5 s of it checkpoints" in by["steps"].note
        assert all(a.end <= b.start + 1e-9 for a, b in zip(rows, rows[1:], strict=False))
        assert abs(sum(r.seconds for r in rows) - tl.wall_s) < 1e-6 and tl.wall_s == 62


def test_requeued_job_counts_from_its_last_start_and_marks_outside_the_span_are_clamped():
    tl, follow = _timeline()
    metrics, _ = _job(0.0)
    metrics["timing"]["args_parsed"] = T0 - 100  # a wrong clock: clamped to the follow span
    log = (f'SLURM_GPU_JOB {{"restart": 0, "t": {T0 + 6}}}\n'
           f'SLURM_GPU_JOB {{"restart": 1, "t": {T0 + 9}}}\n')
    timeline.add_job(tl, follow, metrics, log)
    by = {r.key: r for r in tl.rows()}
    assert abs(by["queue"].seconds - 4) < 1e-6
    assert all(r.start >= T0 and r.end <= T0 + 62 for r in tl.rows())
    assert by["exit"].source == "fab"  # no end stamp: the exit is what fab saw


def test_training_sides_own_phases_are_used_when_metrics_has_them(tmp_path):
    tl, follow = _timeline()
    metrics = {"timing": {"trained": T0 + 50}, "phases": {"0": [
        {"name": "imports", "start": T0 + 7, "end": T0 + 20},
        {"name": "model load", "start": T0 + 20, "end": T0 + 28},
        {"name": "steps", "start": T0 + 29, "end": T0 + 50}]}}
    timeline.add_job(tl, follow, metrics, f'SLURM_GPU_JOB {{"t": {T0 + 7}}}\n')
    keys = [r.key for r in tl.rows()]
    assert keys[keys.index("queue"):] == ["queue", "imports", "model load", "gap", "steps", "exit", "download"]
    pred = {"setup": 1.0, "queue": 3.0}
    text = "\n".join(tl.table(pred))
    assert "wall time" in text and "predicted" in text and "imports" in text
    saved = json.loads(tl.save(tmp_path / "timeline.json", pred).read_text())
    assert saved["wall_s"] == 62 and saved["predicted_s"] == pred
    assert [p["key"] for p in saved["phases"]] == keys


def test_the_wall_time_counts_from_the_process_start_not_from_the_first_import():
    """Time an interpreter spends before ops.finetune.timeline is imported (fab's own imports) is in the run."""
    import subprocess
    import sys

    code = ("import time; t0 = time.time(); time.sleep(1.0)\n"
            "from ops.finetune import timeline\n"
            "print(t0 - timeline.process_started())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=timeline.Path(timeline.__file__).parents[2])
    early = float(out.stdout)
    assert 0.0 <= early < 1.0, early  # started before t0 (interpreter start), and not the import's time
