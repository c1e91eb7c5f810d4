"""FP8 weights: fine-grained e4m3 in 128x128 blocks, activations quantized per token in groups of 128.

Why: every decode step (an AR step or a tree round) is bound by reading the target's weights; FP8 halves
the bytes. The layout is the one Qwen's FP8 releases, transformers ("fine-grained FP8"), vLLM and SGLang
use: `weight` e4m3 [N, K] and `weight_scale_inv` float32 [ceil(N/128), ceil(K/128)], W = W_fp8 *
scale_inv blockwise. `--quantize fp8` writes the same layout from bf16 weights at load.

The GEMM, out = (x quantized per token-group) @ W^T with both scales applied per 128-wide K block, in
one fixed arithmetic per weight shape and device. A row's result therefore does not depend on how many
rows share the call (a lone AR step, a 17-row verify, a batch, a prefill chunk after a cached prefix):
the speculative path and its AR reference agree, and a seed gives one text.
- on Hopper (gemm_path "scaled_mm+triton"): cuBLASLt's block-scaled GEMM (scaled_mm_gemm) for each
  weight shape choose_gemms finds row-invariant at load, the Triton kernel for the others; with
  `--fp8-gemm triton` the Triton kernel's wgmma tiles (HOPPER_TILES: weight-major at decode row counts,
  row-major above with x padded to whole tiles of rows, operands by tensor descriptors) for every weight
  of whole blocks, faster than cuBLASLt up to ~128 rows and 1.01-1.33x slower from ~272;
- on the other GPUs with FP8 tensor cores (gemm_path "triton") and Hopper's remaining shapes:
  quantize_groups_cuda (one small launch: codes and scales of x), then _block_gemm_kernel: per K block
  the dot of e4m3 codes from zero times the product of the row's and the weight block's scales (one
  multiply-add an output), summed in block order
  within groups of k_group blocks (from the weight's shape, never the row count), the groups added in
  order; when the rows are few each group runs in a program of its own and _sum_parts_kernel adds
  them (the same bits). Its tile comes from a table measured on the H200 (TILES), its stages from the
  device's shared memory. A weight-major launch of the same kernel (GemmTile.weights_left: out^T = W x^T,
  wgmma even at one row on Hopper) is a candidate fp8_gemm_bench.py times; no table chooses it yet;
- elsewhere (CPU, CI; gemm_path "torch") the same per-block arithmetic in torch (block_products: each
  block's dot exact in float64). The kernels run through Triton's interpreter in
  tests/runtime/test_triton_kernels.py and must agree with it.

Serving an FP8 model is exact with respect to that FP8 model (speculative decoding verifies against
it), not with respect to the bf16 model it came from; bench/fp8_accuracy.py measures how far it is."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import nn

from ..limits import FP8_GEMMS

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path below is used
    triton = None

BLOCK = 128          # weight blocks are BLOCK x BLOCK, activation groups 1 x BLOCK
E4M3_MAX = 448.0     # the largest finite float8_e4m3fn
MIN_AMAX = 1e-10     # a group of zeros still gets a (tiny) scale, never a division by zero
FP8 = torch.float8_e4m3fn


class BlockFP8(NamedTuple):
    """An FP8 weight as the GEMM reads it. scale_rows: output rows that share one row of scales: 128
    (the checkpoint's blocks) or 1 (rows fused from projections whose sizes are not multiples of 128,
    each row then carrying its block's scales)."""
    qweight: torch.Tensor    # [N, K] float8_e4m3fn
    scale_inv: torch.Tensor  # [ceil(N / scale_rows), ceil(K / 128)] float32
    scale_rows: int


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], float32 scale_inv [ceil(N/128), ceil(K/128)]): each 128x128 block
    scaled so its largest magnitude is E4M3_MAX, rounded to nearest."""
    n, k = w.shape
    nb, kb = cdiv(n, BLOCK), cdiv(k, BLOCK)
    padded = w.new_zeros(nb * BLOCK, kb * BLOCK, dtype=torch.float32)
    padded[:n, :k] = w.float()
    blocks = padded.view(nb, BLOCK, kb, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=MIN_AMAX) / E4M3_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q.view(nb * BLOCK, kb * BLOCK)[:n, :k].contiguous(), scale


def expand_scales(scale_inv: torch.Tensor, scale_rows: int, n: int, k: int) -> torch.Tensor:
    """Block scales -> one scale per weight element [n, k]."""
    return scale_inv.repeat_interleave(scale_rows, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]


def dequantize(w: BlockFP8) -> torch.Tensor:
    """The float32 weight an FP8 weight stands for."""
    n, k = w.qweight.shape
    return w.qweight.float() * expand_scales(w.scale_inv, w.scale_rows, n, k)


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations x [M, K] -> (e4m3 [M, K], float32 scales [M, ceil(K/128)]), per token in groups of
    128 (dynamic: from this x's own magnitudes), as the kernel does on its tiles."""
    m, k = x.shape
    kb = cdiv(k, BLOCK)
    padded = x.new_zeros(m, kb * BLOCK, dtype=torch.float32)
    padded[:, :k] = x.float()
    groups = padded.view(m, kb, BLOCK)
    scale = groups.abs().amax(dim=-1).clamp(min=MIN_AMAX) / E4M3_MAX
    q = (groups / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q.view(m, kb * BLOCK)[:, :k], scale


def block_products(q: torch.Tensor, x_scale: torch.Tensor, w: BlockFP8) -> torch.Tensor:
    """float32 [M, N]: the sum over K blocks kb, in order, of dot(q[m, kb], w[n, kb]) * (x_scale[m, kb] *
    w_scale[n, kb]), as the kernel computes it (on a GPU each term is one fused multiply-add). Each block's
    dot of e4m3 codes is exact in float64 (the products are multiples of 2**-18 below 2**18, 128 of them
    stay far inside 53 bits) whatever order the matmul sums them in, so a row's result does not depend on
    how many rows run beside it."""
    m, k = q.shape
    n = w.qweight.shape[0]
    w_scale = w.scale_inv.repeat_interleave(w.scale_rows, 0)[:n]
    acc = torch.zeros(m, n, dtype=torch.float32, device=q.device)
    for kb in range(cdiv(k, BLOCK)):
        cols = slice(kb * BLOCK, (kb + 1) * BLOCK)
        dot = (q[:, cols].double() @ w.qweight[:, cols].double().t()).float()
        acc += dot * (x_scale[:, kb, None] * w_scale[None, :, kb])
    return acc


def fp8_linear_torch(x: torch.Tensor, w: BlockFP8, bias: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None) -> torch.Tensor:
    """The GEMM's arithmetic in torch (the CPU path and the kernel's reference): x [..., K] ->
    [..., N] in x's dtype, plus the residual if given."""
    x2 = x.reshape(-1, x.shape[-1])
    out = block_products(*quantize_groups(x2), w)
    if bias is not None:
        out = out + bias.float()
    out = out.view(*x.shape[:-1], -1)
    if residual is not None:  # the sum rounded once, as the kernel (and addmm_ in 16 bits) does
        out = residual.float() + out
    return out.to(x.dtype)


def fp8_linear(x: torch.Tensor, w: BlockFP8, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) (+ residual, written over it in place on a GPU, as
    kernels.residual_linear does in 16 bits). On a GPU with FP8 tensor cores cuBLASLt's block-scaled
    GEMM for the weight shapes choose_gemms found row-invariant (at their row floor), else the Triton path; elsewhere
    fp8_linear_torch. Either way a row's result does not depend on the other rows of the call."""
    if not _use_kernel(x):
        return fp8_linear_torch(x, w, bias, residual)
    n, k = w.qweight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = None if residual is None else residual.view(-1, n)
    key = (x.device.index or 0, n, k, w.scale_rows)
    floor = SCALED_MM_SHAPES.get(key)
    if floor:
        out = scaled_mm_linear(x2, w, bias, out, floor)
    else:
        tile = (hopper_tile(x2.shape[0], n, k) if key in WGMMA_SHAPES else
                gemm_tile(x2.shape[0], n, k, *_device_limits(x.device.index or 0)))
        out = block_gemm(x2, w, tile, bias, out, residual=residual is not None)
    return residual if residual is not None else out.view(*x.shape[:-1], n)


def _use_kernel(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda and not torch.is_grad_enabled() and gemm_path(x.device) != "torch"


@functools.lru_cache(maxsize=None)
def gemm_path(device: torch.device) -> str:
    """The FP8 GEMMs a device runs, chosen once per device (named in the log and in /health):
    `scaled_mm+triton` on Hopper (cuBLASLt's block-scaled GEMM for the weight shapes choose_gemms finds
    row-invariant, the Triton kernel for the rest), `triton` on the other GPUs with FP8 tensor cores
    (compute capability 8.9 and up: Ada, Blackwell; cuBLASLt's 128x128 block scaling is Hopper-only),
    `torch` (the CPU path's arithmetic) elsewhere."""
    if device.type != "cuda" or triton is None:
        return "torch"
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        return "torch"
    return "scaled_mm+triton" if cap[0] == 9 and hasattr(torch.nn.functional, "scaled_mm") else "triton"


# (device index, N, K, scale_rows) of the weights fp8_linear gives to cuBLASLt -> the fewest rows each call
# is given (scaled_mm_rows' floor; choose_gemms fills it)
SCALED_MM_SHAPES: dict[tuple[int, int, int, int], int] = {}
# floors choose_gemms tries, in order: cuBLASLt picks its kernel by the row count, and on the H200 some
# shapes (the 27B's o_proj and down_proj, the 8B's down_proj) sum a row differently at 16 rows than at
# 17 and more: given at least 32 rows, every call takes the second kind
SCALED_MM_FLOORS = (16, 32, 64)
# (device index, N, K, scale_rows) of the weights fp8_linear gives to the Triton kernel's wgmma tiles
# (hopper_tile; choose_gemms with prefer="triton" fills it)
WGMMA_SHAPES: set[tuple[int, int, int, int]] = set()
# row counts choose_gemms checks, with the largest pass the engine runs
PROBE_ROWS = (1, 2, 7, 15, 16, 17, 31, 33, 48, 64, 100, 128, 136, 200, 256, 272, 300, 512, 1024, 2048, 4096, 8192)


def fp8_weights(model: nn.Module) -> list[BlockFP8]:
    """Every FP8 weight a model's forward multiplies by: its FP8Linears' and the fused ones its modules
    hold (layers.fuse_rows: a BlockFP8, a (weight, bias) pair, or RowParts)."""
    found = [m.block() for m in model.modules() if isinstance(m, FP8Linear)]
    for m in model.modules():
        stack = list(vars(m).values())
        while stack:
            v = stack.pop()
            if isinstance(v, BlockFP8):
                found.append(v)
            elif isinstance(v, tuple):
                stack.extend(v)
    return found


def choose_gemms(model: nn.Module, device: torch.device, dtype: torch.dtype, max_rows: int,
                 prefer: str = "auto") -> dict[str, str]:
    """On a `scaled_mm+triton` device, each FP8 weight shape's GEMM, decided once at load, for weights of
    whole 128x128 blocks: with prefer="triton", the Triton kernel's wgmma tiles (hopper_tile: `triton-wgmma`)
    where they give every row of the output, at each of PROBE_ROWS (up to max_rows, the largest pass)
    and at max_rows, the bits it has among max_rows rows (activations in `dtype`); else cuBLASLt's
    block-scaled GEMM where it does so, with calls padded to the first of SCALED_MM_FLOORS that makes it
    so (`scaled_mm/32`: at least 32 rows a call); the Triton kernel's TILES otherwise (`triton/G` where it
    sums K in G groups: k_group), and for weights whose scales are per row. Returns "NxK" -> the GEMM,
    for the log."""
    if prefer not in FP8_GEMMS:
        raise ValueError(f"fp8_gemm must be one of {FP8_GEMMS}, got {prefer!r}")
    if gemm_path(device) != "scaled_mm+triton":
        return {}
    index = device.index or 0
    rows = sorted({r for r in PROBE_ROWS if r < max_rows} | {max_rows})
    chosen = {}
    for n, k, scale_rows in sorted({(*w.qweight.shape, w.scale_rows) for w in fp8_weights(model)}):
        key = (index, n, k, scale_rows)
        if scale_rows == BLOCK and k % BLOCK == 0:
            if prefer == "triton" and _rows_independent(n, k, rows, device, dtype, wgmma_gemm):
                WGMMA_SHAPES.add(key)
                chosen[f"{n}x{k}"] = "triton-wgmma"
                continue
            floor = next((f for f in SCALED_MM_FLOORS
                          if _rows_independent(n, k, rows, device, dtype, functools.partial(scaled_mm_gemm, floor=f))),
                         None)
            if floor:
                SCALED_MM_SHAPES[key] = floor
        groups = cdiv(cdiv(k, BLOCK), k_group(n, k, _device_limits(index)[0]))
        floor = SCALED_MM_SHAPES.get(key)
        chosen[f"{n}x{k}"] = (("scaled_mm" if floor == 16 else f"scaled_mm/{floor}") if floor else
                              "triton" if groups == 1 else f"triton/{groups}")
    return chosen


def _rows_independent(n: int, k: int, rows: list[int], device: torch.device, dtype: torch.dtype, gemm) -> bool:
    """Whether gemm(x, w) (scaled_mm_gemm at a floor, or wgmma_gemm) gives each row the same bits at
    every row count in `rows` (random data)."""
    g = torch.Generator(device=device).manual_seed(0)
    with torch.inference_mode():
        w = BlockFP8(*quantize_blocks(torch.randn(n, k, device=device, generator=g) * 0.02), BLOCK)
        x = torch.randn(rows[-1], k, device=device, generator=g).to(dtype)
        try:
            full = gemm(x, w)
            same = all(torch.equal(gemm(x[:m], w), full[:m]) for m in rows[:-1])
        except Exception:  # noqa: BLE001 - a shape cuBLASLt or this GPU's compiler does not take: TILES serve it
            same = False
    torch.cuda.empty_cache()
    return same


@functools.lru_cache(maxsize=None)
def _device_limits(device: int) -> tuple[int, int]:
    """(multiprocessors, shared memory a program may take in bytes) of a CUDA device."""
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, getattr(props, "shared_memory_per_block_optin", 99 * 1024)


def default_tile(m: int, n: int, sms: int) -> "GemmTile":
    """One tile of 16 rows up to 16 rows, with N tiles narrow enough for about two programs per SM
    (the GEMM is bound by reading W); 32 rows above, N tiles of 32 to 128 as the rows grow."""
    if m > 16:
        return GemmTile(32, 32 if m <= 64 else 64 if m <= 128 else 128, 4, 4 if m <= 64 else 3)
    block_n = 128
    while block_n > 32 and cdiv(n, block_n) < 2 * sms:
        block_n //= 2
    return GemmTile(16, block_n, 4, 4)


def k_group(n: int, k: int, sms: int) -> int:
    """The K blocks _block_gemm_kernel sums per group for an [N, K] weight: from its shape and the device
    alone, never the row count (a row's sum order is then the same alone and batched). The measured table's
    (K_GROUPS), else about four programs per SM at the narrowest tile when the rows are few (a 5120-wide
    output fills 160 programs of 32 columns: each would stream all of K alone), at least 8 blocks a group."""
    if (n, k) in K_GROUPS:
        return K_GROUPS[(n, k)]
    blocks = cdiv(k, BLOCK)
    groups = max(1, min(blocks // 8, round(4 * sms / cdiv(n, 32))))
    return cdiv(blocks, groups)


def gemm_tile(m: int, n: int, k: int, sms: int, shared: int) -> "GemmTile":
    """The tile for an [m, k] x [k, n] GEMM: the measured table's, else default_tile, with no more
    pipeline stages than the device's shared memory holds (an RTX PRO 6000's SM has about 100 KB, an
    H200's 228 KB)."""
    tile = next((t for rows, t in TILES.get((n, k), ()) if m <= rows), None) or default_tile(m, n, sms)
    stage = (tile.block_m + tile.block_n) * BLOCK     # an e4m3 tile of x and one of W per stage
    return tile._replace(stages=max(2, min(tile.stages, (shared - 8192) // stage)))


if triton is not None:
    @triton.jit
    def _round_to_e4m3(v):
        """Round float32 v (|v| <= 448) to the nearest e4m3 value, ties to even, in float32 arithmetic,
        so the cast that follows is exact: the same codes as torch's cast, and in Triton's interpreter
        too (whose own float32 -> e4m3 cast rounds values just below a power of two down a binade)."""
        bits = v.to(tl.int32, bitcast=True)
        # normal numbers: keep 3 of the 23 mantissa bits (add half an ulp, minus one unless the kept
        # bit is odd, then clear the dropped bits; 0xFFF00000 as an int32 is -1048576)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
        # below 2**-6, e4m3 is subnormal: multiples of 2**-9, rounded by adding a constant whose ulp is that
        subnormal = (v + 24576.0) - 24576.0
        return tl.where(tl.abs(v) < 0.015625, subnormal, normal)

if triton is not None:
    @triton.jit(do_not_specialize=["M", "M_OUT"])
    def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, M, M_OUT, K, stride_xm, stride_qm, stride_sk,
                                ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
        """x [M, K] -> e4m3 codes q [M_OUT, K] and float32 scales s [ceil(K/128), M_OUT] (token-major, the
        layout cuBLASLt's 1x128 scales take); rows M..M_OUT (padding) are written as zeros."""
        rm = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        kb = tl.program_id(1)
        k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=(rm < M)[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10) / 448.0
        q = _round_to_e4m3(tl.clamp(x / scale[:, None], -448.0, 448.0)).to(tl.float8e4nv)
        out_ok = rm < M_OUT
        tl.store(q_ptr + rm[:, None] * stride_qm + k[None, :], q, mask=out_ok[:, None] & k_ok[None, :])
        tl.store(s_ptr + kb * stride_sk + rm, scale, mask=out_ok)

    @triton.jit
    def _scaled_block_dot(left, right, xs_ptrs, ws_ptrs, kb, K, stride_xsk, rk, left_at, right_at,
                          BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, WEIGHTS_LEFT: tl.constexpr,
                          WS_UNIFORM: tl.constexpr, TMA: tl.constexpr):
        """K block kb's term of _block_gemm_kernel's sum: the dot of its e4m3 codes from zero times the
        product of the token's and the weight block's scales (the caller's += makes it one multiply-add).
        With TMA `left` and `right` are tensor descriptors whose tiles start at rows left_at and right_at
        (the bulk tensor copies fill rows and K past the matrices with zeros)."""
        if TMA:
            a = left.load([left_at, kb * BLOCK_K])
            b = right.load([right_at, kb * BLOCK_K]).T
        elif EVEN_K:
            a = tl.load(left + kb * BLOCK_K)
            b = tl.load(right + kb * BLOCK_K)
        else:
            k_ok = rk < K - kb * BLOCK_K
            a = tl.load(left + kb * BLOCK_K, mask=k_ok[None, :], other=0.0)
            b = tl.load(right + kb * BLOCK_K, mask=k_ok[:, None], other=0.0)
        xs = tl.load(xs_ptrs + kb * stride_xsk)
        ws = tl.load(ws_ptrs + kb)
        if WS_UNIFORM and WEIGHTS_LEFT:
            term = tl.dot(a, b) * (xs * ws)[None, :]
        elif WS_UNIFORM:
            term = tl.dot(a, b) * (xs * ws)[:, None]
        elif WEIGHTS_LEFT:
            term = tl.dot(a, b) * (xs[None, :] * ws[:, None])
        else:
            term = tl.dot(a, b) * (xs[:, None] * ws[None, :])
        return term

    @triton.jit(do_not_specialize=["M"])
    def _block_gemm_kernel(q_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, M, N, K, GROUP, stride_qm,
                           stride_xsk, stride_wn, stride_wsn, stride_om, SCALE_ROWS: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                           HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SPLIT: tl.constexpr,
                           WEIGHTS_LEFT: tl.constexpr, WS_UNIFORM: tl.constexpr, ONE_GROUP: tl.constexpr,
                           TMA: tl.constexpr, TAIL: tl.constexpr, TAIL_ROWS: tl.constexpr, tail_q_ptr):
        """out[m, n] (+)= the sum, over groups of GROUP K blocks in order, of each group's sum over its
        blocks kb, in order and from zero, of dot(q[m, kb], w[n, kb]) * (xs[kb, m] * ws[n, kb]). With
        WS_UNIFORM (the W tile inside one 128-row block of scales) the scales' product is one per token
        and each output takes a single multiply-add per K block (two multiplies and an add before: 5-10%
        of the weight-major tiles' time at 4,096 rows on the H200, session 24). Each block's
        dot starts from zero and GROUP depends on the weight's shape alone, so a row's result does not
        depend on the tile it lands in nor on the rows beside it. With SPLIT, program (tile, g) sums group g
        alone into part[g] (float32) and _sum_parts_kernel adds the groups in order: the same bits, the
        K walk spread over more programs when the rows are few.
        WEIGHTS_LEFT computes the transposed tile, out^T = W x^T, with the same sums: the W tile [BLOCK_N,
        128] is the dot's left operand (the MMA's M side, which Hopper's wgmma needs 64 of, so BLOCK_N of 64
        or 128 runs wgmma even at one row) and BLOCK_M tokens the right one. Each token is then a column of
        the MMA whose K walk is the weight tile's, whatever BLOCK_M is, and on the H200 wgmma gives a column
        the same bits at every BLOCK_M (16-256), the bits of the row-major 64-row tiles (fp8_gemm_bench.py,
        sessions 23 and 24).
        With TMA, q_ptr and w_ptr are tensor descriptors (Hopper's bulk tensor copies into shared memory,
        no addresses in registers): the same products of the same codes.
        With TAIL, the last tile of rows (TAIL_ROWS of them or fewer) runs weight-major with TAIL_ROWS tokens
        (tail_q_ptr: q read as such tiles, by a tensor descriptor with TMA; None without TAIL), a quarter of
        a 64-row tile's MMA work (a 272-row verify's last 64-row tile holds 16 rows). The weight-major form
        sums as the 64-row tiles do, to the same bits (on the H200, sessions 23-24)."""
        num_m = tl.cdiv(M, BLOCK_M)
        pid = tl.program_id(0)
        pid_m, pid_n = pid % num_m, pid // num_m   # programs side by side share a tile of W (read once)
        if TAIL:
            if pid_m == num_m - 1:
                _gemm_tile(tail_q_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, M, N, K, GROUP,
                           stride_qm, stride_xsk, stride_wn, stride_wsn, stride_om,
                           pid_m * (BLOCK_M // TAIL_ROWS), pid_n, SCALE_ROWS, TAIL_ROWS, BLOCK_N, BLOCK_K,
                           EVEN_K, HAS_BIAS, HAS_RESIDUAL, SPLIT, True, WS_UNIFORM, ONE_GROUP, TMA)
            else:
                _gemm_tile(q_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, M, N, K, GROUP,
                           stride_qm, stride_xsk, stride_wn, stride_wsn, stride_om, pid_m, pid_n, SCALE_ROWS,
                           BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, HAS_BIAS, HAS_RESIDUAL, SPLIT, WEIGHTS_LEFT,
                           WS_UNIFORM, ONE_GROUP, TMA)
        else:
            _gemm_tile(q_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, M, N, K, GROUP, stride_qm,
                       stride_xsk, stride_wn, stride_wsn, stride_om, pid_m, pid_n, SCALE_ROWS, BLOCK_M, BLOCK_N,
                       BLOCK_K, EVEN_K, HAS_BIAS, HAS_RESIDUAL, SPLIT, WEIGHTS_LEFT, WS_UNIFORM, ONE_GROUP, TMA)

    @triton.jit
    def _gemm_tile(q_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, M, N, K, GROUP, stride_qm, stride_xsk,
                   stride_wn, stride_wsn, stride_om, pid_m, pid_n, SCALE_ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                   HAS_RESIDUAL: tl.constexpr, SPLIT: tl.constexpr, WEIGHTS_LEFT: tl.constexpr,
                   WS_UNIFORM: tl.constexpr, ONE_GROUP: tl.constexpr, TMA: tl.constexpr):
        # _block_gemm_kernel's tile (pid_m, pid_n): rows pid_m * BLOCK_M.., outputs pid_n * BLOCK_N..
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        lm, ln = rm % M, rn % N            # loads wrap inside the matrices; the store masks
        # a tile is [tokens, outputs], or [outputs, tokens] with WEIGHTS_LEFT; `tokens` and `cols` are
        # out's row and column indices laid out as the tile is, for the epilogue
        if WEIGHTS_LEFT:
            tokens, cols = rm[None, :], rn[:, None]
            left_at, right_at = pid_n * BLOCK_N, pid_m * BLOCK_M
            if TMA:
                left, right = w_ptr, q_ptr
            else:
                left = w_ptr + ln[:, None] * stride_wn + rk[None, :]
                right = q_ptr + lm[None, :] * stride_qm + rk[:, None]
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            tokens, cols = rm[:, None], rn[None, :]
            left_at, right_at = pid_m * BLOCK_M, pid_n * BLOCK_N
            if TMA:
                left, right = q_ptr, w_ptr
            else:
                left = q_ptr + lm[:, None] * stride_qm + rk[None, :]
                right = w_ptr + ln[None, :] * stride_wn + rk[:, None]
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        xs_ptrs = xs_ptr + lm
        if WS_UNIFORM:   # the tile's one row of block scales (wrapped rows past N are masked at the store)
            ws_ptrs = ws_ptr + (pid_n * BLOCK_N // SCALE_ROWS) * stride_wsn
        else:
            ws_ptrs = ws_ptr + (ln // SCALE_ROWS) * stride_wsn
        blocks = tl.cdiv(K, BLOCK_K)
        first, last = 0, blocks
        if SPLIT:
            first = tl.program_id(1) * GROUP
            last = tl.minimum(first + GROUP, blocks)
        if ONE_GROUP:   # one group a program (all of K, or a split launch's): its sum is the total, and
            # the registers hold one accumulator beside the dot's tile, not two (a 128x128 tile fits 8 warps)
            for kb in range(first, last):
                total += _scaled_block_dot(left, right, xs_ptrs, ws_ptrs, kb, K, stride_xsk, rk, left_at, right_at,
                                           BLOCK_K, EVEN_K, WEIGHTS_LEFT, WS_UNIFORM, TMA)
        else:
            for g in range(first, last, GROUP):
                acc = tl.zeros_like(total)
                for kb in range(g, tl.minimum(g + GROUP, blocks)):
                    acc += _scaled_block_dot(left, right, xs_ptrs, ws_ptrs, kb, K, stride_xsk, rk, left_at,
                                             right_at, BLOCK_K, EVEN_K, WEIGHTS_LEFT, WS_UNIFORM, TMA)
                total += acc
        ok = (tokens < M) & (cols < N)
        if SPLIT:
            tl.store(part_ptr + (tl.program_id(1) * M + tokens) * N + cols, total, mask=ok)
        else:
            if HAS_BIAS:
                bias = tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
                total += bias[:, None] if WEIGHTS_LEFT else bias[None, :]
            ptrs = out_ptr + tokens * stride_om + cols
            if HAS_RESIDUAL:
                total += tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
            tl.store(ptrs, total.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit(do_not_specialize=["M"])
    def _sum_parts_kernel(part_ptr, bias_ptr, out_ptr, M, N, GROUPS, stride_om, HAS_BIAS: tl.constexpr,
                          HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        """out = part[0] + part[1] + ... (in order) + bias (+ the residual in out): _block_gemm_kernel's
        epilogue after a split launch, the same additions in the same order."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < M * N
        total = tl.load(part_ptr + i, mask=ok, other=0.0)
        for g in range(1, GROUPS):
            total += tl.load(part_ptr + g * M * N + i, mask=ok, other=0.0)
        m, n = i // N, i % N
        if HAS_BIAS:
            total += tl.load(bias_ptr + n, mask=ok, other=0.0).to(tl.float32)
        ptrs = out_ptr + m * stride_om + n
        if HAS_RESIDUAL:
            total += tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
        tl.store(ptrs, total.to(out_ptr.dtype.element_ty), mask=ok)


class GemmTile(NamedTuple):
    """One launch of _block_gemm_kernel: block_m token rows by block_n weight rows. weights_left: the
    weight-major variant (the W tile as the dot's left operand); tma: the operands read by tensor
    descriptors (Hopper's bulk copies; where a matrix's rows are not 16-byte aligned, as a weight mapped
    straight from a checkpoint file can be, block_gemm reads by pointers: the same sums). HOPPER_TILES
    takes both. tail: a row-major tile's last tile of rows, where it holds TAIL_ROWS or fewer, taken
    weight-major by TAIL_ROWS tokens (a candidate fp8_gemm_bench.py times, which no table chooses yet);
    padded: a TMA tile's codes of x written to whole tiles of rows (zeros past M), so that no bulk copy
    reads past the matrix (HOPPER_TILES' row-major tile). Measured on the GPU and removed (session 31):
    persistent launches (each program taking tiles in turn) and Triton's warp-specialized K walk, both
    slower than these launches at 68-4,096 rows."""
    block_m: int
    block_n: int
    warps: int
    stages: int
    weights_left: bool = False
    tma: bool = False
    tail: bool = False
    padded: bool = False


TAIL_ROWS = 16   # the rows a GemmTile.tail launch's last tile may hold (its token tile)


# The Triton kernel's tiles are all of 16 or 32 rows: those run mma.sync on a Hopper GPU, tiles of 64
# rows wgmma, and the two round a K block's dot differently (measured on the H200: a row's bits differ
# between the families, never within one), so one family for every row count keeps a row's result
# independent of the row count. The 16/32 family is the faster at decode sizes (1-16 rows: 28-58 us
# against 44-111 for 64-row tiles on the 27B shapes), where the Triton kernel serves (choose_gemms).
# (N, K) -> [(up to this many rows, tile)]: the fastest 16/32-row tile per row count on the H200
# (bench/results/runtime-fp8-gemm-families-27b-v1.json); other shapes take default_tile's.
def _table(rows_tiles: list[tuple[int, tuple[int, int, int, int]]]) -> list[tuple[int, GemmTile]]:
    return [(rows, GemmTile(*tile)) for rows, tile in rows_tiles]


_LARGE = [(64, (32, 64, 4, 3)), (128, (32, 64, 4, 3)), (1 << 62, (32, 128, 4, 3))]
TILES: dict[tuple[int, int], list[tuple[int, GemmTile]]] = {
    (16480, 5120): _table([(1, (16, 128, 8, 4)), (16, (16, 32, 4, 4)), (17, (32, 32, 4, 4))] + _LARGE),
    (14336, 5120): _table([(1, (16, 128, 8, 4)), (16, (16, 32, 4, 4)), (17, (32, 32, 4, 4))] + _LARGE),
    (5120, 6144): _table([(16, (16, 64, 4, 4)), (17, (32, 64, 4, 3)), (64, (32, 32, 4, 4))] + _LARGE[1:]),
    (34816, 5120): _table([(1, (16, 128, 8, 4)), (16, (16, 64, 4, 4)), (17, (32, 128, 4, 3))] + _LARGE),
    (5120, 17408): _table([(16, (16, 64, 4, 4)), (17, (32, 64, 4, 3)), (64, (32, 32, 4, 4))] + _LARGE[1:]),
}


# The wgmma family on Hopper (choose_gemms with prefer="triton"; Hopper has bulk tensor copies, so every
# tile reads by tensor descriptors): weight-major tiles up to 32 rows (the W tile as wgmma's 64-row M
# side whatever the token count), the row-major 64x128 tile above. Every tile of the family gives a row the
# same bits at every row count (measured on the five 27B shapes, 1-4,096 rows), so a shape changes tiles
# by row count within one arithmetic. H200, us (bench/results/runtime-fp8-gemm-large-tma-27b-s24-h200.json,
# bf16 in brackets): o_proj 14.1-15.2 at 1-17 rows (18.1-18.3), 16.9 at 64 (18.8), 33.6 at 272 (28.2), 341
# at 4,096 (359); gate_up 46.3-49.8 (86), 49.9 (96), 150 (144), 1,681 (2,086); down_proj 27.7-29.7
# (49-50), 34.5 (51), 80.6 (76), 965 (1,049). cuBLASLt (the "auto" choice) is faster from ~272 rows
# (272: 24.4 / 134 / 60; 4,096: 264 / 1,357 / 743) and slower below (21.5 / 63-67 / 51: its 32-row floor).
# The row-major tile reads x's codes padded to whole 64-row tiles: a bulk copy of a tile that reaches past
# the matrix cost a 272-row launch 12-25% (the same code and grid as 320 rows, slower), and padding takes
# 3-22% off the row counts a verify of 17-node trees leaves short (68-272 rows; o_proj and down_proj
# within 2% either way), the same bits (bench/results/runtime-fp8-large-ws-s31-h200.json).
_WM16 = GemmTile(16, 64, 4, 4, weights_left=True, tma=True)
_WM32 = GemmTile(16, 128, 4, 4, weights_left=True, tma=True)
_RM = GemmTile(64, 128, 4, 3, tma=True, padded=True)
HOPPER_TILES: dict[tuple[int, int], list[tuple[int, GemmTile]]] = {
    (5120, 6144): [(16, _WM16), (32, _WM32), (1 << 62, _RM._replace(stages=4))],
    (34816, 5120): [(16, _WM16), (32, GemmTile(32, 128, 8, 3, weights_left=True, tma=True)), (1 << 62, _RM)],
    (5120, 17408): [(32, _WM32), (1 << 62, _RM._replace(stages=4))],
}
HOPPER_DEFAULT = [(16, _WM16), (32, _WM32), (1 << 62, _RM)]


def hopper_tile(m: int, n: int, k: int) -> GemmTile:
    """The wgmma family's tile for m rows of an [N, K] weight (HOPPER_TILES, else HOPPER_DEFAULT)."""
    return next(t for rows, t in HOPPER_TILES.get((n, k), HOPPER_DEFAULT) if m <= rows)


def wgmma_gemm(x2: torch.Tensor, w: BlockFP8) -> torch.Tensor:
    """block_gemm at hopper_tile's tile for x2's rows (what fp8_linear runs for a WGMMA_SHAPES weight)."""
    n, k = w.qweight.shape
    return block_gemm(x2, w, hopper_tile(x2.shape[0], n, k))


# (N, K) -> K blocks per group of the Triton kernel on the H200 (k_group): the fastest of 1, 2, 4 and 8
# groups at 1-17 rows (bench/results/runtime-fp8-gemm-groups-27b-v1.json)
K_GROUPS: dict[tuple[int, int], int] = {(5120, 6144): 12, (5120, 17408): 34}


def quantize_groups_cuda(x2: torch.Tensor, rows_out: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_groups on the GPU in one launch: (e4m3 [rows_out, K], float32 scales [ceil(K/128),
    rows_out]); rows past x2's are zeros (cuBLASLt's padding)."""
    m, k = x2.shape
    rows_out = m if rows_out is None else rows_out
    kb = cdiv(k, BLOCK)
    q = torch.empty((rows_out, k), dtype=FP8, device=x2.device)
    s = torch.empty((kb, rows_out), dtype=torch.float32, device=x2.device)
    rows = 4
    _quantize_groups_kernel[(cdiv(rows_out, rows), kb)](x2, q, s, m, rows_out, k, x2.stride(0), q.stride(0),
                                                        s.stride(0), ROWS=rows, BLOCK_K=BLOCK, num_warps=4)
    return q, s


def block_gemm(x2: torch.Tensor, w: BlockFP8, tile: GemmTile, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None, residual: bool = False, group: int | None = None,
               split: bool | None = None) -> torch.Tensor:
    """The Triton path: x2 [M, K] quantized by quantize_groups_cuda, then _block_gemm_kernel with `tile`,
    summing K in groups of `group` blocks (k_group's, for the weight's shape, if None); the groups run
    in programs of their own (split) when the tiles alone would not fill the GPU, unless `split` says.
    With residual=True `out` holds the residual and receives the sum."""
    m, k = x2.shape
    n = w.qweight.shape[0]
    sms = _device_limits(x2.device.index or 0)[0]
    blocks = cdiv(k, BLOCK)
    group = min(group or k_group(n, k, sms), blocks)
    groups = cdiv(blocks, group)
    tiles = cdiv(m, tile.block_m) * cdiv(n, tile.block_n)
    if split is None:
        split = groups > 1 and tiles < sms
    padded = tile.padded and tile.tma and not tile.weights_left
    q, s = quantize_groups_cuda(x2, cdiv(m, tile.block_m) * tile.block_m if padded else None)
    if out is None:
        out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    part = torch.empty((groups, m, n), dtype=torch.float32, device=x2.device) if split else out
    q_arg, w_arg = q, w.qweight
    if tile.tma and any(t.data_ptr() % 16 or t.stride(0) % 16 for t in (q, w.qweight)):
        tile = tile._replace(tma=False)   # bulk copies need 16-byte aligned rows: the same sums by pointers
    tail = tile.tail and not tile.weights_left and not split and 0 < m % tile.block_m <= TAIL_ROWS
    tail_q = q if tail else None
    if tile.tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        q_arg = TensorDescriptor.from_tensor(q, [tile.block_m, BLOCK])
        w_arg = TensorDescriptor.from_tensor(w.qweight, [tile.block_n, BLOCK])
        if tail:
            tail_q = TensorDescriptor.from_tensor(q, [TAIL_ROWS, BLOCK])
    _block_gemm_kernel[(tiles, groups if split else 1)](
        q_arg, s, w_arg, w.scale_inv, bias if bias is not None else out, out, part, m, n, k, group, q.stride(0),
        s.stride(0), w.qweight.stride(0), w.scale_inv.stride(0), out.stride(0), SCALE_ROWS=w.scale_rows,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=BLOCK, EVEN_K=k % BLOCK == 0,
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual, SPLIT=split, WEIGHTS_LEFT=tile.weights_left,
        WS_UNIFORM=w.scale_rows % tile.block_n == 0, ONE_GROUP=split or groups == 1, TMA=tile.tma,
        TAIL=tail, TAIL_ROWS=TAIL_ROWS, tail_q_ptr=tail_q,
        num_warps=tile.warps, num_stages=tile.stages)
    if split:
        _sum_parts_kernel[(cdiv(m * n, SUM_BLOCK),)](part, bias if bias is not None else out, out, m, n, groups,
                                                     out.stride(0), HAS_BIAS=bias is not None,
                                                     HAS_RESIDUAL=residual, BLOCK=SUM_BLOCK, num_warps=4)
    return out


SUM_BLOCK = 1024   # outputs per program of _sum_parts_kernel


def scaled_mm_rows(m: int, floor: int = 16) -> int:
    """The rows cuBLASLt's block-scaled GEMM is given: m padded to a multiple of 16 (it refuses 1 and 17),
    and to `floor` at least (the weight's, SCALED_MM_SHAPES)."""
    return max(floor, cdiv(m, 16) * 16)


def scaled_mm_linear(x2: torch.Tensor, w: BlockFP8, bias: torch.Tensor | None, out: torch.Tensor | None,
                     floor: int = 16) -> torch.Tensor:
    """fp8_linear through scaled_mm_gemm (the call choose_gemms probed); the bias and the residual (`out`,
    which receives the sum) are added after it, in x2's dtype: one rounding more than the Triton kernel,
    the same for every row count."""
    y = scaled_mm_gemm(x2, w, floor)
    if bias is not None:
        y = y + bias
    return out.add_(y) if out is not None else y


def scaled_mm_gemm(x2: torch.Tensor, w: BlockFP8, floor: int = 16) -> torch.Tensor:
    """PyTorch's block-scaled GEMM (cuBLASLt, Hopper): 1x128 activation scales, 128x128 weight scales;
    [M, N] in x2's dtype (a view of the padded result, scaled_mm_rows(M, floor) rows)."""
    from torch.nn.functional import ScalingType, scaled_mm
    m = x2.shape[0]
    q, s = quantize_groups_cuda(x2, scaled_mm_rows(m, floor))
    out = scaled_mm(q, w.qweight.t(), s.t(), ScalingType.BlockWise1x128, w.scale_inv.t(),
                    ScalingType.BlockWise128x128, output_dtype=x2.dtype)
    return out[:m]


class FP8Linear(nn.Module):
    """A Linear with an FP8 weight; its state dict is the checkpoint's (`weight`, `weight_scale_inv`,
    `bias`), so a fine-grained FP8 checkpoint loads into it as it is."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(cdiv(out_features, BLOCK), cdiv(in_features, BLOCK)),
                                             requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.scale_rows = BLOCK

    @classmethod
    def quantized(cls, linear: nn.Linear) -> "FP8Linear":
        """`--quantize fp8`: the blocks of a bf16 (or float32) Linear's weight."""
        bias = linear.bias
        out = cls(linear.in_features, linear.out_features, bias is not None, linear.weight.dtype)
        q, scale = quantize_blocks(linear.weight.detach())
        out.weight = nn.Parameter(q, requires_grad=False)
        out.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
        if bias is not None:
            out.bias = nn.Parameter(bias.detach(), requires_grad=False)
        return out

    def block(self) -> BlockFP8:
        return BlockFP8(self.weight, self.weight_scale_inv, self.scale_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.block(), self.bias)

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x + self(y), the sum written over x by the GEMM on CUDA (x: a residual stream nothing else holds)."""
        return fp8_linear(y, self.block(), self.bias, residual=x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 blocks of {BLOCK}"


def fuse_fp8_rows(linears: list[FP8Linear], pad: bool = False) -> tuple[BlockFP8, torch.Tensor | None]:
    """layers.fuse_rows for FP8 projections: one weight, its scales and bias, with each module's
    parameters made row slices of them. Where a projection's rows are not a multiple of 128 (a
    tiny model's k/v, a hybrid's gate inputs) its block scales would straddle the next one's: with
    `pad` each projection then starts at a multiple of 128 rows, the gap zero rows (their outputs
    zeros, layers.split_parts skips them), and the scales stay the checkpoint's 128-row blocks, which
    cuBLASLt's block-scaled GEMM takes; else the fused scales are kept per row (a row's scale is its
    block's)."""
    aligned = all(lin.scale_rows == BLOCK and lin.out_features % BLOCK == 0 for lin in linears)
    padded = pad and not aligned and all(lin.scale_rows == BLOCK for lin in linears)
    rows = BLOCK if aligned or padded else 1
    span = [cdiv(lin.out_features, BLOCK) * BLOCK if padded else lin.out_features for lin in linears]

    def grown(t: torch.Tensor, n: int) -> torch.Tensor:   # t's rows, then zero rows up to n
        return t if t.shape[0] == n else torch.cat([t, t.new_zeros(n - t.shape[0], *t.shape[1:])])

    scales = [lin.weight_scale_inv if rows == BLOCK else lin.weight_scale_inv.repeat_interleave(lin.scale_rows, 0)
              [:lin.out_features] for lin in linears]
    q = torch.cat([grown(lin.weight, n) for lin, n in zip(linears, span)])
    s = torch.cat(scales)
    b = torch.cat([grown(lin.bias, n) for lin, n in zip(linears, span)]) if linears[0].bias is not None else None
    row = 0
    for lin, n_span in zip(linears, span):
        n = lin.out_features
        lin.weight = nn.Parameter(q[row:row + n], requires_grad=False)
        lin.weight_scale_inv = nn.Parameter(s[row // rows:row // rows + cdiv(n, rows)], requires_grad=False)
        lin.scale_rows = rows
        if b is not None:
            lin.bias = nn.Parameter(b[row:row + n], requires_grad=False)
        row += n_span
    return BlockFP8(q, s, rows), b


def slice_rows(w: BlockFP8, start: int) -> BlockFP8:
    """Rows start.. of a fused FP8 weight (the drafter's k/v without q); start must begin a scale row."""
    if start % w.scale_rows:
        raise ValueError(f"row {start} splits a block of {w.scale_rows} rows that share scales")
    return BlockFP8(w.qweight[start:], w.scale_inv[start // w.scale_rows:], w.scale_rows)


def skipped(name: str, skip: tuple[str, ...]) -> bool:
    """Whether module `name` stays unquantized: the LM head always, and what modules_to_not_convert names
    (a full name, its end, or one part of it; a multimodal release's `model.language_model.` names are
    this runtime's `model.`)."""
    names = [s.replace("model.language_model.", "model.", 1) for s in skip]
    return name == "lm_head" or any(name == s or name.endswith("." + s) or s in name.split(".") for s in names)


def quantize_linears(model: nn.Module, skip: tuple[str, ...] = ()) -> list[str]:
    """`--quantize fp8`: every Linear of the model but the LM head (and what `skip` names) replaced by
    its FP8 blocks. Embeddings, norms and convolutions are not Linears and stay. Returns the names."""
    names = [name for name, m in model.named_modules() if type(m) is nn.Linear and not skipped(name, skip)]
    for name in names:
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, attr, FP8Linear.quantized(getattr(owner, attr)))
    return names


def fp8_modules(model: nn.Module, state: dict[str, torch.Tensor], dtype: torch.dtype) -> list[str]:
    """A fine-grained FP8 checkpoint: every Linear whose weight the state dict holds in e4m3 (with its
    weight_scale_inv) becomes an (empty, meta) FP8Linear that the state dict then loads into; the
    others stay as they are, as the checkpoint left them (an FP8 LM head is then refused at load).
    Returns the names."""
    names = [name for name, m in model.named_modules() if type(m) is nn.Linear and not skipped(name, ())
             and state.get(f"{name}.weight", torch.empty(0)).dtype == FP8]
    for name in names:
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent)
        old = getattr(owner, attr)
        setattr(owner, attr, FP8Linear(old.in_features, old.out_features, old.bias is not None, dtype))
    return names
