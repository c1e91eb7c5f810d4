"""The ddops local lab: real Debian 12 hosts booted with systemd-nspawn on this machine.

Each host is an overlay over one cached debootstrap rootfs (LAB_DIR/base-bookworm), shares the
control machine's network and listens for SSH on its own 127.0.0.1 port. The API has no click in
it; `ddops lab up|down|status` wraps it.

Environment:
    DDOPS_LAB_DIR           where the lab lives (default /var/lib/ddops/lab)
    DDOPS_LAB_ROOTFS_CACHE  a tarball of the base rootfs: unpacked when the base is missing,
                            written after a build (lets CI build the rootfs once per run)
    DDOPS_LAB_MIRROR        Debian mirror for debootstrap (default: the one apt uses here)
    DDOPS_LAB_KEEP=1        tests leave the lab running at the end of the session

Inside every host: /etc/ddops-lab/gpus.json + /usr/bin/nvidia-smi (imitation GPUs; a process
holds GPU memory by writing /run/ddops-gpu/<pid>.json, see assets/ddops_lab_gpu.py),
/etc/pip.conf using /opt/wheels (bound read-only) and the control machine's CA bundle.
"""

from .api import LabHostState, lab_down, lab_status, lab_up
from .errors import LabError
from .paths import LAB_DIR

__all__ = ["LAB_DIR", "LabError", "LabHostState", "lab_down", "lab_status", "lab_up"]
