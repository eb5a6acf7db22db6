"""slurm-gpu: tasks that run on a deployed cluster (`fab --list` is the menu).

`fab train` targets the current Pulumi stack; `fab train --target local` the local
cluster (`fab local.up`).
"""

from invoke import Collection

from localcluster.tasks import ns as local_ns

ns = Collection()
ns.add_collection(local_ns, "local")
