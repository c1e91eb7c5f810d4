"""The ddops local lab: real Debian 12 hosts booted with systemd-nspawn on this machine.

Each host is an overlay over one cached debootstrap rootfs, shares the control machine's
network and listens for SSH on its own 127.0.0.1 port. The API below has no click in it;
`ddops lab up|down|status` wraps it.
"""

from .api import LabHostState, lab_down, lab_status, lab_up
from .errors import LabError
from .paths import LAB_DIR

__all__ = ["LAB_DIR", "LabError", "LabHostState", "lab_down", "lab_status", "lab_up"]
