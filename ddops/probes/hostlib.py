"""Shared by the facts, inspect and bench probes and the stop_training, lock, unitfile and balancer actions
(probe_source prepends it to their text): running a command, reading a process, a log's last step, the
newest checkpoint and its step, a JSON file read and written whole (temp + fsync + rename), HAProxy's
runtime API, a progress line for the control machine.

Every script that scans processes carries MARKER in its own text, so a scan skips ddops's scripts
(this one's, or a concurrent run's, whose arguments may name the training pattern).
"""
import json
import os
import re
import socket
import subprocess
import sys

MARKER = "ddops-probe"
PROGRESS = "ddops-progress: "   # remote.PROGRESS_PREFIX: a line the control machine shows as it comes


def say(message):
    """One progress line, shown by the control machine as it comes (BrokenPipeError once it has gone)."""
    sys.stdout.write(PROGRESS + message + "\n")
    sys.stdout.flush()


def run(argv, timeout=10):
    """(exit code, stdout, stderr); a missing command is 127 and a timeout 124, as a shell says."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        return done.returncode, done.stdout, done.stderr
    except FileNotFoundError:
        return 127, "", "%s: command not found" % argv[0]
    except subprocess.TimeoutExpired:
        return 124, "", "%s timed out" % argv[0]
    except OSError as exc:
        return 126, "", str(exc)


def cmdline(pid):
    """pid's command line, "" when it has gone or is a kernel thread."""
    try:
        with open("/proc/%s/cmdline" % pid, "rb") as fh:
            return " ".join(a.decode(errors="replace") for a in fh.read().split(b"\0") if a)
    except OSError:
        return ""


def matching_pids(pattern):
    """(pid, command line) of processes whose command line matches pattern: not this script, not its
    shell, not any other ddops script."""
    rx = re.compile(pattern)
    me = {os.getpid(), os.getppid()}
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        if int(entry) in me:
            continue
        command = cmdline(entry)
        if command and rx.search(command) and MARKER not in command:
            found.append((int(entry), command))
    return found


def log_tail(log_path, size=65536):
    """The log's last `size` bytes as text; "" when there is no log."""
    if not log_path:
        return ""
    try:
        with open(log_path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - size))
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def last_step(log_path, size=65536):
    """The last `step N` in the log's last `size` bytes, or None."""
    steps = re.findall(r"\bstep[ =:]+(\d+)", log_tail(log_path, size))
    return int(steps[-1]) if steps else None


def last_loss(log_path, size=65536):
    """The last `loss X` in the log's last `size` bytes, or None."""
    losses = re.findall(r"\bloss[ =:]+([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)", log_tail(log_path, size))
    return float(losses[-1]) if losses else None


# A checkpoint's step from its name: `step_1200.ckpt`, `checkpoint-1200`, `ckpt1200`, `epoch_2_step_1200`;
# else the name's last number (`model_1200.pt`).
_STEP_IN_NAME = re.compile(r"(?:step|checkpoint|ckpt|iter)[_-]?(\d+)", re.IGNORECASE)


def checkpoint_step(name):
    """The training step a checkpoint's file or directory name says, or None."""
    named = _STEP_IN_NAME.findall(name)
    if named:
        return int(named[-1])
    numbers = re.findall(r"\d+", name)
    return int(numbers[-1]) if numbers else None


def newest_checkpoint(folder):
    """The checkpoint written last in folder (dot-files and `*.tmp`, which are still being written, skipped):
    its path, step (from its name) and mtime; None when there is none."""
    if not folder:
        return None
    try:
        names = [e for e in os.listdir(folder) if not e.startswith(".") and not e.endswith((".tmp", ".partial"))]
    except OSError:
        return None
    entries = []
    for name in names:
        try:
            entries.append((os.path.getmtime(os.path.join(folder, name)), name))
        except OSError:  # removed meanwhile (a trainer rotating its checkpoints)
            continue
    if not entries:
        return None
    mtime, name = max(entries)
    return {"path": os.path.join(folder, name), "step": checkpoint_step(name), "mtime": mtime}


def read_json(path):
    """A JSON file's content; None when it does not exist, {"unreadable": True} when it cannot be read."""
    try:
        with open(path) as fh:
            return json.load(fh)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {"unreadable": True}


def write_atomic(path, data, mode=0o600):
    """Write a file whole or not at all: a temp file beside it, fsync, rename, fsync of the folder."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, ".%s.ddops-tmp" % os.path.basename(path))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, mode)
    os.replace(tmp, path)
    dfd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def haproxy_command(path, line):
    """One HAProxy runtime API command over its admin socket; HAProxy answers, then closes."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(10)
    try:
        conn.connect(path)
        conn.sendall((line + "\n").encode())
        chunks = []
        while True:
            data = conn.recv(65536)
            if not data:
                break
            chunks.append(data)
    finally:
        conn.close()
    return b"".join(chunks).decode(errors="replace")


def haproxy_servers(path, backend):
    """A backend's servers from `show stat`: name -> status (UP, DOWN, DRAIN, MAINT...), current
    sessions, queue, weight, last check, and the requests HAProxy had to retry or send elsewhere and the
    connection or response errors it saw (counters since it started)."""
    text = haproxy_command(path, "show stat")
    lines = [l for l in text.splitlines() if l.strip()]
    if not lines or not lines[0].startswith("# "):
        raise RuntimeError("unexpected answer to `show stat`: %r" % text[:200])
    header = lines[0][2:].split(",")
    out = {}
    for line in lines[1:]:
        row = dict(zip(header, line.split(",")))
        if row.get("pxname") != backend or row.get("svname") in ("FRONTEND", "BACKEND"):
            continue
        out[row["svname"]] = {"status": row.get("status"), "sessions": int(row.get("scur") or 0),
                              "queued": int(row.get("qcur") or 0), "weight": int(row.get("weight") or 0),
                              "check": row.get("check_status"), "retries": int(row.get("wretr") or 0),
                              "redispatches": int(row.get("wredis") or 0), "errors": int(row.get("eresp") or 0)
                              + int(row.get("econ") or 0)}
    return out
