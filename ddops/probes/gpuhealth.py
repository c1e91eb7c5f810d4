"""GPU health for the facts probe (probe_source prepends it): the driver and the CUDA version it supports,
each GPU's uncorrectable ECC counts, pending remaps or retired pages, throttle reasons and the processes
holding its memory, and the Xid events in the kernel log since boot. Every fact a tool, field or
permission does not give is None ("unknown"), never an error.
"""
import os
import re

# Asked with the GPUs' own fields, in the same nvidia-smi call (ddops.gpuhealth reads them).
HEALTH_FIELDS = ["driver_version", "pci.bus_id", "ecc.errors.uncorrected.volatile.total",
                 "ecc.errors.uncorrected.aggregate.total", "remapped_rows.pending", "retired_pages.pending",
                 "clocks_throttle_reasons.active"]
# clocks_throttle_reasons.active bits that mean the card is held back (NVML's nvmlClocksThrottleReason*);
# idle (0x1), application clocks (0x2), sync boost (0x10) and display clocks (0x100) are settings, not trouble.
THROTTLE_BITS = [(0x4, "SwPowerCap"), (0x8, "HwSlowdown"), (0x20, "SwThermalSlowdown"),
                 (0x40, "HwThermalSlowdown"), (0x80, "HwPowerBrakeSlowdown")]
IDLE_MIB = 64     # a GPU using more than this has a process on it worth naming (the driver's own is a few MiB)
# `NVRM: Xid (PCI:0000:18:00): 79, pid=..., GPU has fallen off the bus.` (the driver's kernel message)
XID_LINE = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)[^)]*\): (\d+),? ?(.*)")
CUDA_LINE = re.compile(r"CUDA Version\s*:\s*(\d+\.\d+)")
KMSG = "/dev/kmsg"


def cell(text):
    """A CSV cell as nvidia-smi prints it; None where the card has no such value ([N/A], [Not Supported])."""
    text = text.strip()
    if not text or text.startswith("[") or text in ("N/A", "Not Supported"):
        return None
    return text


def count(text):
    value = cell(text)
    return int(value) if value is not None and value.isdigit() else None


def yes_no(text):
    value = cell(text)
    return None if value is None else value.lower() in ("yes", "1", "true")


def throttle_reasons(text):
    """The bits of a throttle mask (`0x0000000000000048`) that hold the card back; None when not given."""
    value = cell(text)
    try:
        mask = int(value, 16) if value is not None else None
    except ValueError:
        return None
    return None if mask is None else [name for bit, name in THROTTLE_BITS if mask & bit]


def bus_key(bus_id):
    """`0000:18:00` from nvidia-smi's `00000000:18:00.0` or a kernel line's `0000:18:00` (domain, bus, device)."""
    match = re.match(r"([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)", bus_id or "")
    if not match:
        return None
    domain, bus, device = (int(part, 16) for part in match.groups())
    return "%04x:%02x:%02x" % (domain, bus, device)


def health_cells(cells):
    """The health fields of one GPU's CSV row (HEALTH_FIELDS' order)."""
    driver, bus_id, volatile, aggregate, remap, retired, throttle = cells
    return {"driver_version": cell(driver), "bus_id": cell(bus_id), "bus": bus_key(bus_id),
            "ecc_volatile": count(volatile), "ecc_aggregate": count(aggregate), "remap_pending": yes_no(remap),
            "retired_pending": yes_no(retired), "throttle": throttle_reasons(throttle)}


def unit_of_pid(pid):
    """The systemd unit a process runs in (from its cgroup), or None."""
    try:
        with open("/proc/%d/cgroup" % pid) as fh:
            text = fh.read()
    except (OSError, ValueError):
        return None
    units = re.findall(r"/([^/\n]+\.(?:service|scope))(?=/|$)", text, re.MULTILINE)
    return units[-1] if units else None


def holders(rows):
    """Each GPU's processes (pid, name, MiB, unit, and whether the pid is in this host's /proc: in a
    container the driver may name the host's pids), asked only when a GPU's memory is in use; the GPUs of
    `rows` get `processes` (None: unknown)."""
    if not any((r.get("memory_used_mib") or 0) > IDLE_MIB for r in rows):
        for r in rows:
            r["processes"] = []
        return
    code, out, _ = run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory,gpu_bus_id",
                        "--format=csv,noheader,nounits"])
    by_bus = dict((r.get("bus"), r) for r in rows)
    for r in rows:
        r["processes"] = [] if code == 0 and r.get("bus") else None
    if code != 0:
        return
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4 or not parts[0].isdigit():
            continue
        gpu = by_bus.get(bus_key(parts[-1]))
        if gpu is not None and gpu["processes"] is not None:
            pid = int(parts[0])
            gpu["processes"].append({"pid": pid, "name": ",".join(parts[1:-2]), "used_mib": count(parts[-2]),
                                     "unit": unit_of_pid(pid), "seen": os.path.isdir("/proc/%d" % pid)})


def kmsg_lines():
    """The kernel's ring buffer since boot (or since it last wrapped) as (seconds since boot, message)."""
    fd = os.open(KMSG, os.O_RDONLY | os.O_NONBLOCK)
    chunks = []
    try:
        while True:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:   # the end of the buffer
                break
            except BrokenPipeError:   # a record overwritten while reading: go on with the next
                continue
            if not data:              # a regular file (the lab's imitation) ends like this
                break
            chunks.append(data)
    finally:
        os.close(fd)
    lines = []
    for record in b"".join(chunks).decode(errors="replace").splitlines():
        head, sep, message = record.partition(";")
        fields = head.split(",")
        if sep and len(fields) >= 3 and fields[2].isdigit():
            lines.append((int(fields[2]) / 1e6, message))
    return lines


def journal_lines():
    """The journal's kernel messages of this boot, as (seconds since boot, message)."""
    code, out, err = run(["journalctl", "-k", "-b", "-q", "--no-pager", "-o", "short-monotonic"])
    if code != 0:
        raise OSError((err or out).strip() or "journalctl exit %d" % code)
    lines = []
    for line in out.splitlines():
        match = re.match(r"\[\s*(\d+\.\d+)\]\s+\S+\s+kernel:\s?(.*)", line)
        if match:
            lines.append((float(match.group(1)), match.group(2)))
    return lines


def xid_events():
    """Xid events since boot, each with the GPU's bus id: from /dev/kmsg, else the journal; the error
    says why neither could be read (then the events are unknown, not none)."""
    errors = []
    for source, read in ((KMSG, kmsg_lines), ("journalctl -k", journal_lines)):
        try:
            lines = read()
        except OSError as exc:
            errors.append("%s: %s" % (source, getattr(exc, "strerror", None) or exc))
            continue
        events = []
        for seconds, message in lines:
            match = XID_LINE.search(message)
            if match:
                domain, bus, device, code, rest = match.groups()
                events.append({"xid": int(code), "bus": bus_key("%s:%s:%s" % (domain, bus, device)),
                               "at_s": round(seconds, 3), "text": rest.strip()[:200]})
        return {"source": source, "error": None, "events": events}
    return {"source": None, "error": "; ".join(errors), "events": None}


def cuda_version():
    """The highest CUDA version the driver supports: `nvidia-smi --version` (R550+), else its table's header."""
    for argv in (["nvidia-smi", "--version"], ["nvidia-smi"]):
        code, out, _ = run(argv)
        match = CUDA_LINE.search(out) if code == 0 else None
        if match:
            return match.group(1)
    return None


def driver_facts(rows, with_cuda):
    """The driver's version (from the GPUs' rows) and, when asked, the CUDA version it supports."""
    versions = [r.get("driver_version") for r in rows if r.get("driver_version")]
    return {"version": versions[0] if versions else None, "cuda": cuda_version() if with_cuda and rows else None}

