"""slurm-gpu: a Slurm GPU cluster on AWS (see README.md and docs/CONFIG.md)."""

from infra.program import main

main()
