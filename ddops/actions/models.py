"""ddops-action models: keep what a sync replaces, and put it back.

`keep` (before the pivot's first change): the kept folder of a model dir (`paths.replaced_dir`) is
emptied of an older pivot's files and marked with this pivot's id and the files its sync will add. The
sync's rsync then moves every file it replaces or deletes into `KEEP/files` (`--backup-dir`), same
relative path, a rename on the same filesystem.

`restore`: the kept files moved back, the files the sync added removed (and folders left empty by
that), rsync's holding dirs cleared, a model dir the sync created removed if empty. Only for the pivot
that kept them (the id); idempotent (a retried restore finishes what the first began), and marked done
so that a second one changes nothing.
"""
import json
import os
import shutil
import sys
# read_json and write_atomic come from hostlib.py, which probe_source() prepends to this script.

HOLDING = ".~tmp~"


def inside(root, rel):
    """root/rel when it stays under root (a relative path from our own listing; never trusted blindly)."""
    full = os.path.normpath(os.path.join(root, rel))
    return full if full.startswith(root.rstrip("/") + "/") else None


def keep(spec):
    folder = spec["keep"]
    shutil.rmtree(folder, ignore_errors=True)
    try:
        os.makedirs(os.path.join(folder, "files"), mode=0o700)
        write_atomic(os.path.join(folder, "keep.json"),
                     json.dumps({k: spec[k] for k in ("id", "path", "added", "new_dir")}))
    except OSError as exc:
        return {"error": "keeping what the sync replaces in %s failed: %s" % (folder, exc.strerror or exc)}
    return {"kept": folder}


def restore(spec):
    path, folder = spec["path"].rstrip("/"), spec["keep"]
    marker = read_json(os.path.join(folder, "keep.json"))
    if not isinstance(marker, dict) or "id" not in marker:
        return {"restored": False, "why": "nothing is kept in %s (a later pivot replaced it, or it was removed)"
                % folder}
    if marker["id"] != spec["id"]:
        return {"restored": False, "why": "%s keeps the files of another pivot (%s)" % (folder, marker["id"])}
    if marker.get("done"):
        return {"restored": True, "already": True, "moved_back": 0, "removed": 0}
    files, moved, removed = os.path.join(folder, "files"), 0, 0
    for top, dirs, names in os.walk(path, topdown=False):
        if os.path.basename(top) == HOLDING:
            shutil.rmtree(top, ignore_errors=True)
    for top, dirs, names in os.walk(files):
        for name in names:
            kept = os.path.join(top, name)
            target = inside(path, os.path.relpath(kept, files))
            if target is None:
                continue
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.replace(kept, target)
            moved += 1
    for rel in marker.get("added") or []:
        target = inside(path, rel)
        if target is not None and os.path.lexists(target) and not os.path.isdir(target):
            os.unlink(target)
            removed += 1
            parent = os.path.dirname(target)
            while parent != path and parent.startswith(path + "/"):
                try:
                    os.rmdir(parent)   # only an empty one
                except OSError:
                    break
                parent = os.path.dirname(parent)
    if marker.get("new_dir"):
        try:
            os.rmdir(path)
        except OSError:
            pass
    marker["done"] = True
    write_atomic(os.path.join(folder, "keep.json"), json.dumps(marker))
    return {"restored": True, "moved_back": moved, "removed": removed}


def main():
    spec = json.loads(sys.stdin.read())
    json.dump({"keep": keep, "restore": restore}[spec["action"]](spec), sys.stdout)


main()
