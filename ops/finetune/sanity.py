"""Step 4 of `fab train`: the sanity job, one task per GPU node that reports the GPUs it sees; a node
that sees fewer than the inventory says (or does not report) fails the run before training starts."""

from __future__ import annotations

import re
import uuid

from ops.actions import slurm
from ops.finetune import sbatch as jobs
from ops.finetune.trainstep import TrainError, step
from ops.say import Say
from ops.ssh.remote import Cluster, put_text, read_remote

_SANITY = re.compile(r"SANITY host=(?P<host>\S+) gpus=(?P<found>\d+) want=(?P<want>\d+) (?P<rest>.*)$")


def sanity(cl: Cluster, say: Say, timeout_s: float = 600) -> None:
    inv = cl.inventory
    nodes, gpus = len(inv.gpu_nodes), inv.gpus_per_node
    sdir = f"{inv.scratch}/slurm-gpu/sanity"
    script = f"{sdir}/sanity-{uuid.uuid4().hex[:8]}.sbatch"
    slurm.make_job_dir(cl.controller, inv, sdir)
    spec = jobs.base_spec(inv, jobs.SANITY_NAME, nodes, gpus, sdir, script_path=script)
    put_text(cl.controller, jobs.render_sanity(spec), script, 0o755)
    job_id = slurm.submit(cl.controller, script, user=slurm.job_user(inv))
    job = slurm.wait_job(cl.controller, job_id, timeout_s)
    log_path = f"{inv.scratch}/logs/{jobs.SANITY_NAME}-{job_id}.out"
    text = read_remote(cl.controller, log_path, missing_ok=True)
    seen = {m["host"]: m for line in text.splitlines() if (m := _SANITY.search(line))}
    bad = {n.name: (f"{seen[n.name]['found']} of {gpus} GPUs" if n.name in seen else "no report")
           for n in inv.gpu_nodes if n.name not in seen or int(seen[n.name]["found"]) < gpus}
    if bad or not job.ok:
        detail = "\n".join(text.splitlines()[-20:])
        raise TrainError(f"sanity job {job_id} {job.state} (exit {job.exit_code}); "
                         + ("; ".join(f"{h}: {why}" for h, why in bad.items()) or "see the log")
                         + f"\n{log_path}:\n{detail}")
    per_node = ", ".join(f"{h} {m['found']} GPUs ({m['rest'].split()[0]})" for h, m in sorted(seen.items()))
    step(say, 4, f"sanity job {job_id}: {per_node}")
