"""Time SDPA variants for the verify shape (Qwen3-8B heads) at one layer: which form of tree mask and GQA is fast."""
import statistics, torch
import torch.nn.functional as F

def timed(fn, reps=50):
    for _ in range(5): fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts) * 1e3  # us

dev, dt = "cuda", torch.bfloat16
for ctx in (512, 4096):
    for t in (1, 17, 257):
        s = ctx + t
        cap = 4096 + 512
        kbuf = torch.randn(1, 8, cap, 128, device=dev, dtype=dt); vbuf = torch.randn_like(kbuf)
        k, v = kbuf[:, :, :s], vbuf[:, :, :s]
        q = torch.randn(1, 32, t, 128, device=dev, dtype=dt)
        m = torch.ones(t, s, dtype=torch.bool, device=dev); m[:, ctx:] = torch.rand(t, t, device=dev) < 0.5
        m[:, ctx:] |= torch.eye(t, dtype=torch.bool, device=dev)
        bias = torch.zeros(t, s, device=dev, dtype=dt).masked_fill(~m, float("-inf"))
        g = 4
        qf = q.view(1, 8, g * t, 128)
        biasf = bias.repeat(g, 1)
        r = {}
        r["bool+gqa"] = timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True))
        r["bias+gqa"] = timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True))
        r["fold+bias"] = timed(lambda: F.scaled_dot_product_attention(qf, k, v, attn_mask=biasf))
        r["fold+bool"] = timed(lambda: F.scaled_dot_product_attention(qf, k, v, attn_mask=m.repeat(g, 1)))
        r["nomask+gqa"] = timed(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        r["fold nomask"] = timed(lambda: F.scaled_dot_product_attention(qf, k, v))
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=m, enable_gqa=True)
        got = F.scaled_dot_product_attention(qf, k, v, attn_mask=biasf).view(1, 32, t, 128).float()
        err = ((got - ref).norm() / ref.norm()).item()
        print(f"ctx {ctx} T {t}: " + "  ".join(f"{k_} {v_:.0f}us" for k_, v_ in r.items()) + f"  fold err {err:.1e}", flush=True)
