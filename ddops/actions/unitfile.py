"""ddops-action unitfile: back up, install or restore a unit and its environment file, atomically.

Reads its arguments as JSON on stdin (the environment file may hold secrets, which must not show
in the process list). Actions: backup, install (after its own backup, or one `backup` took), list,
restore, discard (a `backup` that no install used). Every write is temp file + fsync + rename; a
backup's meta.json is written last, so a backup without one was never completed. A backup is checked
against its recorded checksums before it is listed as intact or restored, and a restore first backs up
what it replaces.
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
# write_atomic comes from hostlib.py, which probe_source() prepends to this script.


def sha(path):
    try:
        with open(path, "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()
    except FileNotFoundError:
        return None


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


def backup_only(spec):
    """The backup a pivot takes before it changes anything (an install later names it)."""
    try:
        meta = backup(spec)
    except OSError as exc:
        shutil.rmtree(os.path.join(spec["backup_root"], spec["backup_id"]), ignore_errors=True)
        return {"error": "backing up into %s failed: %s" % (spec["backup_root"], exc.strerror or exc)}
    return {"backup_id": spec["backup_id"], "meta": meta}


def discard(spec):
    """Remove the backup a pivot took up front and never used (it ended with nothing changed): left, it
    would be the newest backup, and `ddops rollback` would restore the state that is already there."""
    name = spec["backup_id"]
    if not name or name.startswith(".") or os.sep in name:
        return {"discarded": False}
    folder = os.path.join(spec["backup_root"], name)
    shutil.rmtree(folder, ignore_errors=True)
    return {"discarded": not os.path.exists(folder)}


def damage(folder):
    """(meta, why the backup cannot be trusted or None): meta.json missing or unparsable, a copy missing
    or different from the checksum recorded when it was taken."""
    try:
        with open(os.path.join(folder, "meta.json")) as fh:
            meta = json.load(fh)
    except FileNotFoundError:
        return {}, "meta.json is missing (the backup was never completed)"
    except (OSError, ValueError) as exc:
        return {}, "meta.json does not parse: %s" % exc
    if not isinstance(meta, dict):
        return {}, "meta.json is not a JSON object"
    copies = [("unit", meta.get("unit_existed"), meta.get("unit_sha256")),
              ("env", meta.get("env_existed"), meta.get("env_sha256"))]
    copies += [(item.get("copy"), item.get("existed"), item.get("sha256")) for item in meta.get("files") or []]
    for name, existed, recorded in copies:
        if not existed:
            continue
        found = sha(os.path.join(folder, name))
        if found is None:
            return meta, "its copy %r is missing" % name
        if found != recorded:
            return meta, "its copy %r does not match the checksum recorded when it was taken" % name
    return meta, None


def install(spec):
    meta = backup_meta(spec) if spec.get("backup_taken") else backup(spec)
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


def backup_meta(spec):
    """The meta of the backup a `backup` action took for this install."""
    with open(os.path.join(spec["backup_root"], spec["backup_id"], "meta.json")) as fh:
        return json.load(fh)


def listing(spec):
    root = spec["backup_root"]
    out = []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if name.startswith("."):
            continue
        meta, why = damage(os.path.join(root, name))
        out.append(dict({"id": name, "meta": meta}, **({"damaged": why} if why else {})))
    return out


def restore(spec):
    """Put a backup back (an absent unit is removed again), daemon-reload; first check it against its
    checksums and back up what it replaces (`save_as`). A refusal changes nothing."""
    folder = os.path.join(spec["backup_root"], spec["backup_id"])
    meta, why = damage(folder)
    if why:
        return {"refused": "it is damaged: " + why}
    saved = None
    if spec.get("save_as"):
        save = {"unit": spec["unit"], "unit_path": spec["unit_path"], "env_path": spec["env_path"],
                "backup_root": spec["backup_root"], "backup_id": spec["save_as"],
                "meta": {"reason": "rollback", "replaced_by": spec["backup_id"]},
                "files": [{"path": item["path"], "mode": item["mode"]} for item in meta.get("files") or []]}
        try:
            backup(save)
        except OSError as exc:
            shutil.rmtree(os.path.join(spec["backup_root"], spec["save_as"]), ignore_errors=True)
            return {"refused": "what it would replace could not be backed up first: %s" % (exc.strerror or exc)}
        saved = spec["save_as"]
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
    return {"backup_id": spec["backup_id"], "meta": meta, "saved_as": saved, "before": before,
            "after": {"unit": sha(spec["unit_path"]), "env": sha(spec["env_path"])}, "daemon_reload": reload,
            "changed": changed}


def main():
    spec = json.loads(sys.stdin.read())
    action = spec["action"]
    out = {"backup": backup_only, "discard": discard, "install": install, "list": listing,
           "restore": restore}[action](spec)
    json.dump(out, sys.stdout)


main()
