"""Where the bootstrap installs its programs on every host, whatever the platform."""

HEALTHCHECK_PATH = "/usr/local/sbin/slurm-gpu-healthcheck"
BOOTSTRAP_PATH = "/usr/local/sbin/slurm-gpu-bootstrap"
