"""ddops-action lock: the host's pivot lock, a JSON file created exclusively (O_EXCL).

Actions: acquire (fails with the holder when held), release (only our own token), clear (any).
"""
import json
import os
import sys
# read_json comes from hostlib.py, which probe_source() prepends to this script.


def main():
    spec = json.loads(sys.argv[1])
    path, action = spec["path"], spec["action"]
    if action == "acquire":
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            json.dump({"acquired": False, "holder": read_json(path)}, sys.stdout)
            return
        with os.fdopen(fd, "w") as fh:
            json.dump(spec["holder"], fh)
            fh.flush()
            os.fsync(fh.fileno())
        json.dump({"acquired": True, "holder": spec["holder"]}, sys.stdout)
    elif action == "release":
        holder = read_json(path)
        if holder and holder.get("token") == spec["token"]:
            os.unlink(path)
            json.dump({"released": True}, sys.stdout)
        else:
            json.dump({"released": False, "holder": holder}, sys.stdout)
    elif action == "clear":
        holder = read_json(path)
        if holder is not None:
            os.unlink(path)
        json.dump({"cleared": holder is not None, "holder": holder}, sys.stdout)


main()
