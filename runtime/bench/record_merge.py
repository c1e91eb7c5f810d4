"""Merge a compile record a warm-up made (`h200.sh reship-h100`: the 27B on a card too small for the 96 GB
emulation, so at a shorter max_context) into the record shipped for its model: the new warm-up's compiles,
and the shipped ones it did not reach (compile_pool.merged). Where a kernel's launches changed, the old
launch stays in the record until a warm-up on the whole card makes it again (`h200.sh reship`): a compile
the workers make ahead and nothing uses, where a launch missing from the record is one the warm-up itself
waits for.

    PYTHONPATH=runtime python runtime/bench/record_merge.py MADE.pkl [--into SHIPPED.pkl]"""

import argparse
from collections import Counter
from pathlib import Path

from ddtree_runtime.model.compile_pool import SHIPPED, merged, recorded, save_record

DEFAULT_RECORD = Path(SHIPPED) / "qwen3_5-5120x64-bfloat16-none.pkl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("made", help="the warm-up's record (ddtree-compiles.pkl in its Triton cache)")
    ap.add_argument("--into", default=str(DEFAULT_RECORD), help="the shipped record to merge into (rewritten)")
    args = ap.parse_args()
    made, shipped = recorded(args.made), recorded(args.into)
    if not made:
        ap.error(f"{args.made} holds no compiles: make it by a warm-up over an empty Triton cache "
                 "(h200.sh reship-h100)")
    jobs = merged(made, shipped)
    save_record(jobs, args.into)
    by_name = Counter(job["name"] for job in jobs)
    print(f"{args.into}: {len(jobs)} compiles ({len(made)} made, {len(jobs) - len(made)} kept from the "
          f"{len(shipped)} shipped): " + ", ".join(f"{name} {n}" for name, n in by_name.most_common()))


if __name__ == "__main__":
    main()
