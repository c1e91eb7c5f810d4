"""ddops-probe inspect: what a pivot needs to know about one host, in one round trip.

Runs remotely as `python3 -c SOURCE ARGS_JSON` (stdlib only); prints one JSON object with the
sections asked for: model trees, free disk, where paths lead, port holder(s), files, venv imports,
units, lock, and where commands are (`haproxy` for a replicated profile).
"""
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys

SMALL = 4 * 1024 * 1024  # files up to this size are hashed


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tree(path):
    if not os.path.isdir(path):
        return {"exists": False, "files": {}, "bytes": 0, "config": None}
    files, total = {}, 0
    for top, dirs, names in os.walk(path):
        dirs.sort()
        for name in sorted(names):
            full = os.path.join(top, name)
            if os.path.islink(full) or not os.path.isfile(full):
                continue
            st = os.stat(full)
            rel = os.path.relpath(full, path)
            files[rel] = [st.st_size, int(st.st_mtime), sha256_file(full) if st.st_size <= SMALL else None]
            total += st.st_size
    config = None
    try:
        with open(os.path.join(path, "config.json")) as fh:
            config = json.load(fh)
    except (OSError, ValueError):
        pass
    return {"exists": True, "files": files, "bytes": total, "config": config}


def free(path):
    probe = path
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe.rstrip("/")) or "/"
    st = os.statvfs(probe)
    return {"checked": probe, "free_bytes": st.f_bavail * st.f_frsize, "device": os.stat(probe).st_dev}


def path_facts(path):
    """Where a path ddops will write really leads (symlinks resolved), and what is there now."""
    is_dir = os.path.isdir(path)
    try:
        entries = len(os.listdir(path)) if is_dir else 0
    except OSError:
        entries = None
    return {"real": os.path.realpath(path), "link": os.path.islink(path), "exists": os.path.lexists(path),
            "dir": is_dir, "entries": entries, "venv": os.path.isfile(os.path.join(path, "pyvenv.cfg"))}


def port_holder(port):
    """Who listens on TCP `port`: pid, command and systemd unit (from /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    if not inodes:
        return None
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir("/proc/%s/fd" % pid)
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink("/proc/%s/fd/%s" % (pid, fd))
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                return {"pid": int(pid), "cmdline": cmdline(pid), "unit": unit_of(pid)}
    return {"pid": None, "cmdline": None, "unit": None}


def unit_of(pid):
    try:
        with open("/proc/%s/cgroup" % pid) as fh:
            for line in fh:
                for part in line.strip().split("/"):
                    if part.endswith(".service"):
                        return part
    except OSError:
        pass
    return None


def read_file(path, mask=()):
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return {"exists": False, "sha256": None, "text": None}
    except OSError as exc:
        return {"exists": True, "sha256": None, "text": None, "error": str(exc)}
    text = data.decode(errors="replace")
    if mask:
        lines = []
        for line in text.splitlines():
            key = line.split("=", 1)[0].strip()
            lines.append(key + "=***" if key in mask and "=" in line else line)
        text = "\n".join(lines) + ("\n" if text.endswith("\n") else "")
    return {"exists": True, "sha256": hashlib.sha256(data).hexdigest(), "text": text}


IMPORT_CHECK = r"""
import importlib, importlib.metadata as md, json, sys
out = {}
for name in json.loads(sys.argv[1]):
    try:
        mod = importlib.import_module(name)
        out[name] = {"ok": True, "version": getattr(mod, "__version__", None)}
    except Exception as exc:
        out[name] = {"ok": False, "error": "%s: %s" % (exc.__class__.__name__, str(exc)[:200])}
print(json.dumps(out))
"""


def imports(spec):
    python = spec["python"]
    if not os.path.exists(python):
        return {"venv": False, "modules": {}}
    try:
        done = subprocess.run([python, "-c", IMPORT_CHECK, json.dumps(spec["modules"])],
                              capture_output=True, text=True, timeout=spec.get("timeout", 120))
        return {"venv": True, "modules": json.loads(done.stdout), "error": None}
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        return {"venv": True, "modules": {}, "error": str(exc)}


def units(names):
    out = {}
    props = "ActiveState,SubState,LoadState,UnitFileState,NRestarts,MainPID,FragmentPath"
    for name in names:
        done = subprocess.run(["systemctl", "show", name, "--property=" + props],
                              capture_output=True, text=True, timeout=15)
        out[name] = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    return out


def main():
    args = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    out = {"hostname": socket.gethostname()}
    if "trees" in args:
        out["trees"] = {p: tree(p) for p in args["trees"]}
    if "free" in args:
        out["free"] = {p: free(p) for p in args["free"]}
    if "paths" in args:
        out["paths"] = {p: path_facts(p) for p in args["paths"]}
    if "port" in args:
        out["port"] = port_holder(int(args["port"]))
    if "ports" in args:
        out["ports"] = {str(p): port_holder(int(p)) for p in args["ports"]}
    if "commands" in args:
        out["commands"] = {c: shutil.which(c) for c in args["commands"]}
    if "files" in args:
        out["files"] = {p: read_file(p, tuple(mask)) for p, mask in args["files"].items()}
    if "imports" in args:
        out["imports"] = imports(args["imports"])
    if "units" in args:
        out["units"] = units(args["units"])
    if "lock" in args:
        out["lock"] = read_json(args["lock"])
    if "journal" in args:
        out["journal"] = read_json(args["journal"])
    json.dump(out, sys.stdout)


main()
