"""The tree attention's kernels one by one (torch profiler, device time a call): the 27B's tree (24 / 4 heads
of 256, 17 queries) over the paged pool at rows of equal length, with the split the KV bucket's (the
bucket kernel and its merge), fitted to the rows' lengths (the item kernel, its plan made ahead as a pass
makes it, and its merge), and fixed splits. attn_probe.py times whole calls under CUDA graphs; this says
which kernel a difference lies in (session 35: the item kernel, not its merge, paid more a key).

    PYTHONPATH=runtime:runtime/bench python runtime/bench/attn_kernels.py [--out F.json]"""

import argparse
import json
from pathlib import Path

import torch

from ddtree_runtime.model import kernels
from ddtree_runtime.model.kernels import DecodeLaunch, decode_attention
from gpu_profile import kernel_table

HQ, HKV, D, PAGE, QUERIES = 24, 4, 256, 16, 17
CASES = ((8, 4608, 4100), (16, 4608, 4100), (8, 8704, 7833), (16, 8704, 7833), (16, 33280, 29952))
FIXED_SPLITS = (2176, 4352)


def case(batch: int, bucket: int, real: int, gen: torch.Generator) -> dict:
    """One batch's kernels at each split: rows of about `real` keys in a bucket of `bucket`."""
    lengths = (real + torch.randint(-32, 33, (batch,), generator=gen)).clamp(QUERIES, bucket).cuda()
    width = -(-bucket // PAGE)
    pool = torch.randn(1, HKV, batch * width * PAGE, D, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(batch * width, generator=gen).view(batch, width).cuda()
    q = torch.randn(batch, HQ, QUERIES, D, device="cuda", dtype=torch.bfloat16)
    bias = torch.zeros(batch, 1, QUERIES, bucket, device="cuda", dtype=torch.bfloat16)
    paged = dict(table=table, page_size=PAGE, length=bucket)
    served = kernels.DECODE_FIT_SPLIT
    out = {"batch": batch, "bucket": bucket, "real": real}
    try:
        for name, fitted, launch in (("bucket", False, None), ("fitted", True, None),
                                     *((f"split {s}", False, DecodeLaunch(128, s, 8, 3, 64)) for s in FIXED_SPLITS)):
            kernels.DECODE_FIT_SPLIT = fitted
            plan = kernels.tree_attention_plan(lengths, bucket, QUERIES, HQ, HKV, D) if fitted else None
            _, rows = kernel_table(lambda: decode_attention(q, pool, pool, bias, lengths, launch=launch, shared=True,
                                                            plan=plan, **paged), reps=20)
            out[name] = {kernel: round(us, 2) for kernel, us, _ in rows}
    finally:
        kernels.DECODE_FIT_SPLIT = served
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/runtime-attn-kernels.json")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    cases = []
    for batch, bucket, real in CASES:
        cases.append(case(batch, bucket, real, gen))
        print(f"{batch:3} rows, {bucket:5} bucket: " + "; ".join(
            f"{name} " + " + ".join(f"{us:.1f}" for us in cases[-1][name].values())
            for name in cases[-1] if isinstance(cases[-1][name], dict)), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "unit": "us a call, device time",
                                          "cases": cases}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
