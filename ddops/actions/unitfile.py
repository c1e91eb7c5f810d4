"""ddops-action unitfile: back up, install or restore a unit and its environment file, atomically.

Reads its arguments as JSON on stdin (the environment file may hold secrets, which must not show
in the process list). Actions: install, list, restore. Every write is temp file + fsync + rename.
A replicated profile's other files (per-replica env files, the balancer's config, the replicas
manifest) come as `files` and are backed up, installed and restored with the unit, as one.
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time


def sha(path):
    try:
        with open(path, "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()
    except FileNotFoundError:
        return None


def write_atomic(path, data, mode):
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


def remove(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def systemctl(*args):
    done = subprocess.run(["systemctl"] + list(args), capture_output=True, text=True, timeout=60)
    return {"argv": ["systemctl"] + list(args), "rc": done.returncode, "stderr": done.stderr.strip()[-500:]}


def backup(spec):
    """Copy the installed unit and env file (or note their absence) under backup_root/ID."""
    folder = os.path.join(spec["backup_root"], spec["backup_id"])
    os.makedirs(folder, mode=0o700, exist_ok=False)
    meta = dict(spec.get("meta") or {})
    meta.update(unit=spec["unit"], created=time.time(), unit_sha256=sha(spec["unit_path"]),
                env_sha256=sha(spec["env_path"]), unit_existed=os.path.exists(spec["unit_path"]),
                env_existed=os.path.exists(spec["env_path"]))
    for src, name in ((spec["unit_path"], "unit"), (spec["env_path"], "env")):
        if os.path.exists(src):
            shutil.copy2(src, os.path.join(folder, name))
            os.chmod(os.path.join(folder, name), 0o600)
    extra = []
    for number, item in enumerate(spec.get("files") or []):
        existed = os.path.exists(item["path"])
        extra.append({"path": item["path"], "mode": item["mode"], "existed": existed, "sha256": sha(item["path"]),
                      "copy": "file%d" % number})
        if existed:
            shutil.copy2(item["path"], os.path.join(folder, "file%d" % number))
            os.chmod(os.path.join(folder, "file%d" % number), 0o600)
    if extra:
        meta["files"] = extra
    write_atomic(os.path.join(folder, "meta.json"), json.dumps(meta, indent=1) + "\n", 0o600)
    return meta


def install(spec):
    meta = backup(spec)
    for item in spec.get("files") or []:
        write_atomic(item["path"], item["text"], item["mode"])
    write_atomic(spec["env_path"], spec["env_text"], 0o600)
    write_atomic(spec["unit_path"], spec["unit_text"], 0o644)
    reload = systemctl("daemon-reload")
    out = {"backup_id": spec["backup_id"], "before": {"unit": meta["unit_sha256"], "env": meta["env_sha256"]},
           "after": {"unit": sha(spec["unit_path"]), "env": sha(spec["env_path"])}, "daemon_reload": reload}
    if spec.get("files"):
        out["files"] = {item["path"]: sha(item["path"]) for item in spec["files"]}
    return out


def listing(spec):
    root = os.path.join(spec["backup_root"])
    out = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        try:
            with open(os.path.join(root, name, "meta.json")) as fh:
                meta = json.load(fh)
        except (OSError, ValueError):
            continue
        out.append({"id": name, "meta": meta})
    return out


def restore(spec):
    """Put a backup back (an absent unit is removed again), daemon-reload."""
    folder = os.path.join(spec["backup_root"], spec["backup_id"])
    with open(os.path.join(folder, "meta.json")) as fh:
        meta = json.load(fh)
    before = {"unit": sha(spec["unit_path"]), "env": sha(spec["env_path"])}
    for name, dest, mode in (("unit", spec["unit_path"], 0o644), ("env", spec["env_path"], 0o600)):
        src = os.path.join(folder, name)
        if os.path.exists(src):
            with open(src) as fh:
                write_atomic(dest, fh.read(), mode)
        else:
            remove(dest)
    changed = []
    for item in meta.get("files") or []:
        src = os.path.join(folder, item["copy"])
        now = sha(item["path"])
        if item["existed"]:
            with open(src) as fh:
                write_atomic(item["path"], fh.read(), item["mode"])
        else:
            remove(item["path"])
        if sha(item["path"]) != now:
            changed.append(item["path"])
    reload = systemctl("daemon-reload")
    return {"backup_id": spec["backup_id"], "meta": meta, "before": before,
            "after": {"unit": sha(spec["unit_path"]), "env": sha(spec["env_path"])}, "daemon_reload": reload,
            "changed": changed}


def main():
    spec = json.loads(sys.stdin.read())
    action = spec["action"]
    out = {"install": install, "list": listing, "restore": restore}[action](spec)
    json.dump(out, sys.stdout)


main()
