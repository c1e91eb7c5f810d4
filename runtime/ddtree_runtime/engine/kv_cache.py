"""Target caches, written in place, compacted by index: the KV cache, and for hybrid targets the KV of the
full-attention layers plus the linear layers' recurrent state.

Two layouts of the KV. Contiguous (the model tests, the prefill benchmark): one row of `capacity`
positions per sequence. Paged (the engine's pool): physical pages shared by all rows, each row's
positions mapped through its block table (block_manager.py); every method keeps the contiguous
layout's meaning, in logical positions, and the attention paths read pages through the table
(`pages`: the paged decode kernel) or a gathered copy (`view`: the torch path)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..model.config import Qwen35Config, Qwen3Config
from ..model.gated_delta import Step, advance_along, conv_tail_along
from .block_manager import PageTable


class PagedLayer(NamedTuple):
    """One layer's pages as the paged decode kernel reads them."""
    k: torch.Tensor       # [1, n_kv_heads, pages * page_size, head_dim]
    v: torch.Tensor
    block: torch.Tensor   # [B, width] the rows' page ids
    page_size: int


class KVCache:
    """Contiguous: k, v [n_layers, batch, n_kv_heads, capacity, head_dim], one batch row per sequence.
    Paged (`table` given): k, v [n_layers, n_kv_heads, (pages + 1) * page_size, head_dim] (page 0 the
    scratch page) and `block` [rows, width], the rows' block tables. Either way a pass over rows
    lo..hi-1 works on `rows(lo, hi)`, a view."""

    def __init__(self, n_layers: int, n_kv: int, head_dim: int, capacity: int,
                 device: torch.device | str, dtype: torch.dtype, batch: int = 1,
                 table: PageTable | None = None) -> None:
        self.table = table
        if table is None:
            shape = (n_layers, batch, n_kv, capacity, head_dim)
            self.block = None
            self.page_size = 0
        else:
            self.page_size = table.page_size
            shape = (n_layers, n_kv, (table.manager.num_pages + 1) * table.page_size, head_dim)
            self.block = table.block
            capacity = table.capacity
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.capacity = capacity
        self._memo: list[tuple[torch.Tensor, torch.Tensor]] = []  # _physical's last mappings

    @staticmethod
    def page_bytes(n_layers: int, n_kv: int, head_dim: int, page_size: int, elem: int) -> int:
        return 2 * n_layers * n_kv * head_dim * page_size * elem

    def _physical(self, pos: torch.Tensor) -> torch.Tensor:
        """Logical positions ([T]: the same for every row, or [B, T]) -> physical slots [B, T]. Every
        layer of a pass maps the same positions tensor: it is mapped once (a graph records one gather,
        not one a layer); a new pass brings new tensors."""
        for known, phys in self._memo:
            if known is pos:
                return phys
        flat = pos.expand(self.block.shape[0], -1) if pos.dim() == 1 else pos
        phys = self.block.gather(1, flat // self.page_size) * self.page_size + flat % self.page_size
        self._memo = [(pos, phys), *self._memo[:3]]
        return phys

    def _store(self, layer: int, phys: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, Hkv, T, D] into physical slots phys [B, T] of one layer."""
        idx = phys.reshape(-1)
        h, d = k.shape[1], k.shape[3]
        self.k[layer].index_copy_(1, idx, k.transpose(0, 1).reshape(h, -1, d))
        self.v[layer].index_copy_(1, idx, v.transpose(0, 1).reshape(h, -1, d))

    def view(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s first `length` positions of every row, [B, Hkv, length, D] (paged: gathered
        through the block tables, a copy)."""
        if self.table is None:
            return self.k[layer, :, :, :length], self.v[layer, :, :, :length]
        phys = self._physical(torch.arange(length, device=self.k.device))           # [B, L]
        return self.k[layer][:, phys].transpose(0, 1), self.v[layer][:, phys].transpose(0, 1)

    def held(self, row: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `row`'s first `length` positions of every layer, k and v [n_layers, Hkv, length, D] in
        logical order, whatever the layout (tests and diagnostics compare rows with it)."""
        view = self.rows(row, row + 1)
        k, v = zip(*(view.view(layer, length) for layer in range(self.k.shape[0])))
        return torch.stack(k)[:, 0], torch.stack(v)[:, 0]

    def pages(self, layer: int) -> PagedLayer | None:
        """A paged cache's layer for the paged decode kernel (None: contiguous)."""
        if self.table is None:
            return None
        return PagedLayer(self.k[layer][None], self.v[layer][None], self.block, self.page_size)

    def kernel_target(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where the fused RoPE + KV-write kernel stores positions `slots` ([T] or [B, T]) of layer
        `layer`: (k rows, v rows, slots) with one row per sequence; paged, every row is the whole
        pool (stride 0) and the slots are physical."""
        if self.table is None:
            return self.k[layer], self.v[layer], slots
        b = self.block.shape[0]
        return (self.k[layer][None].expand(b, -1, -1, -1), self.v[layer][None].expand(b, -1, -1, -1),
                self._physical(slots))

    def copy_page(self, src: int, dst: int, count: int) -> None:
        """A paged cache's copy-on-write: page dst takes page src's first `count` positions."""
        a, b = src * self.page_size, dst * self.page_size
        for t in (self.k, self.v):
            t[:, :, b:b + count] = t[:, :, a:a + count]

    def holds(self, capacity: int, nodes: int) -> bool:
        """Whether this cache serves `capacity` slots with tree passes of up to `nodes` nodes."""
        return capacity <= self.capacity

    @property
    def slots(self) -> int:
        return self.k.shape[1] if self.table is None else self.block.shape[0]

    def rows(self, lo: int, hi: int) -> KVCache:
        """The same cache restricted to batch rows lo..hi-1: views, so a pass over them writes here."""
        view = object.__new__(type(self))
        paged = self.table is not None
        view.__dict__.update({name: value if paged and name in ("k", "v") else
                              value[lo:hi] if name == "block" and paged else _rows(value, lo, hi)
                              for name, value in self.__dict__.items()})
        view._memo = []
        return view

    def permute(self, dst: list[int], src: list[int], length: int) -> None:
        """Row dst[i] takes row src[i]'s content (requests changing slots when one leaves, a finished
        one's row kept as a cached sequence): the rows form a permutation, so each tensor's source rows
        are read before any is written, a layer at a time (the temporary is one layer's rows). Of the KV
        only the first `length` positions move: past every moved row's context a row is free."""
        if not dst:
            return
        d, s = (torch.tensor(rows, device=self.k.device) for rows in (dst, src))
        if self.table is None:  # paged, the KV moves with the block tables (PageTable.move)
            for t in (self.k, self.v):
                for layer in t[..., :length, :]:           # [B, Hkv, length, D]
                    layer.index_copy_(0, d, layer.index_select(0, s))
        for t in self._states():
            for layer in t:
                layer.index_copy_(0, d, layer.index_select(0, s))

    def copy_prefix(self, src: int, dst: int, length: int, from_snapshot: bool = False) -> None:
        """Row dst starts with row src's first `length` positions (a cached prefix reused; src == dst:
        already there). `from_snapshot`: a hybrid cache's state at the end of src's prompt. Paged, the
        KV comes with the block tables (PageTable.share and copy_page)."""
        if src != dst and self.table is None:
            for t in (self.k, self.v):
                t[:, dst, :, :length] = t[:, src, :, :length]

    def _states(self) -> list[torch.Tensor]:
        """Per-row tensors a request keeps between rounds besides the KV ([n, B, ...], moved whole)."""
        return []

    def _per_slot(self) -> list[torch.Tensor]:
        return [self.k, self.v, *self._states()]

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([B, Hkv, T, D]) at [start, start+T) and return views of the cache up to start+T."""
        end = start + k.shape[2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: need {end} slots, have {self.capacity}")
        if self.table is not None:
            self._store(layer, self._physical(torch.arange(start, end, device=k.device)), k, v)
            return (k, v) if start == 0 else self.view(layer, end)  # a first piece attends to itself only
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def write_at(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([B, Hkv, T, D]) at cache slots `slots` ([T] long, on the device, or [B, T]: each
        row its own) and return views of the first `length` entries: no host-side offsets, so a CUDA
        graph can replay it."""
        self.put_at(layer, slots, k, v)
        return self.view(layer, length)

    def put_at(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """write_at's store alone (the attention reads the cache itself: layers.attend_cache)."""
        if self.table is not None:
            self._store(layer, self._physical(slots), k, v)
        elif slots.dim() == 1:
            self.k[layer].index_copy_(2, slots, k)
            self.v[layer].index_copy_(2, slots, v)
        else:
            index = slots[:, None, :, None].expand_as(k)
            self.k[layer].scatter_(2, index, k)
            self.v[layer].scatter_(2, index, v)

    def compact(self, start: torch.Tensor | None, nodes: torch.Tensor, length: torch.Tensor,
                moved: int | None = None) -> None:
        """Keep each row's accepted path of the tree pass it wrote at start[b]: row b's tree nodes
        nodes[b, :length[b]] (root first) move to start[b].. in every layer; the rest become free. All
        device values (the walk's own result: a host list would be copied there, and torch waits for
        the device to copy from pageable memory). start, length: [B]; nodes: [B, P]. Slots past a row's
        path get copies of its root: they are beyond its context, free. `moved`: the host's bound on
        the path entries that change place (past it every row's path is in place: an AR step, a path
        down the first branches; 0: none moves, and start may be None); None: up to P."""
        nodes = nodes if moved is None else nodes[:, :moved]
        b, p = nodes.shape
        if p == 0:
            return
        dst = start[:, None] + torch.arange(p, device=nodes.device)          # [B, P]
        src = start[:, None] + nodes
        if self.table is not None:
            self._move_positions(self._physical(dst), self._physical(src))
            return
        rows = torch.arange(b, device=nodes.device)[:, None]
        for t in (self.k, self.v):
            t[:, rows, :, dst] = t[:, rows, :, src]                         # [B, P, L, H, D] moved

    def _move_positions(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Paged: physical slots dst take src's KV in every layer (advanced indexing reads first)."""
        d, s = dst.reshape(-1), src.reshape(-1)
        for t in (self.k, self.v):
            t[:, :, d] = t[:, :, s]


class HybridCache(KVCache):
    """For a hybrid target: KV for the full-attention layers, and for the linear-attention layers the
    committed conv tail and recurrent state plus the last tree pass's per-node scratch (inputs, keys,
    written values, path decays), from which `compact` advances the state along the accepted path.

    Memory: the state is fixed (n_linear x Hv x dk x dv floats); the scratch grows with the tree:
    n_linear x nodes x (Hv x (dk + dv + 1) floats + conv_dim values)."""

    def __init__(self, cfg: Qwen35Config, capacity: int, device: torch.device | str, dtype: torch.dtype,
                 batch: int = 1, nodes: int = 1, snapshots: bool = False, table: PageTable | None = None) -> None:
        super().__init__(cfg.kv_layers, cfg.num_key_value_heads, cfg.head_dim, capacity, device, dtype, batch,
                         table)
        batch = self.slots
        n, hv = len(cfg.linear_layers), cfg.linear_num_value_heads
        dk, dv, kernel = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
        conv_dim = cfg.linear_conv_dim
        f32 = torch.float32
        self.conv = torch.zeros(n, batch, kernel - 1, conv_dim, device=device, dtype=dtype)
        self.state = torch.zeros(n, batch, hv, dk, dv, device=device, dtype=f32)
        self.inputs = torch.zeros(n, batch, nodes, conv_dim, device=device, dtype=dtype)
        self.step = Step(torch.zeros(n, batch, hv, nodes, dk, device=device, dtype=f32),
                         torch.zeros(n, batch, hv, nodes, dv, device=device, dtype=f32),
                         torch.zeros(n, batch, hv, nodes, device=device, dtype=f32))
        # with prefix reuse, each row's conv tail and state at the end of its prompt (engine/prefix_cache.py)
        self.snap_conv = torch.zeros_like(self.conv) if snapshots else None
        self.snap_state = torch.zeros_like(self.state) if snapshots else None
        # a prompt pass's offset (1..its length) at which each linear layer writes its state to the
        # snapshot (set on a row's view for one pass: prefilling.py), so a prompt is not cut there
        self.keep_at: int | None = None

    @staticmethod
    def scratch_bytes(cfg: Qwen35Config, nodes: int, elem: int) -> int:
        hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        return len(cfg.linear_layers) * nodes * (4 * hv * (dk + dv + 1) + elem * cfg.linear_conv_dim)

    def holds(self, capacity: int, nodes: int) -> bool:
        return super().holds(capacity, nodes) and nodes <= self.inputs.shape[2]

    def scratch(self, layer: int, t: int) -> tuple[torch.Tensor, Step]:
        """Layer `layer`'s scratch for a tree pass of t nodes, its inputs and Step, as views (the kernels
        of the tree pass write there directly)."""
        if t > self.inputs.shape[2]:
            raise RuntimeError(f"tree of {t} nodes exceeds the recurrent scratch ({self.inputs.shape[2]})")
        return self.inputs[layer, :, :t], Step(self.step.k[layer, :, :, :t], self.step.u[layer, :, :, :t],
                                               self.step.g[layer, :, :, :t])

    def save_step(self, layer: int, inputs: torch.Tensor, step: Step, t: int) -> None:
        """Keep what a tree pass of layer `layer` over t nodes leaves for `compact` (what is already there,
        written through `scratch`, is not copied)."""
        kept_inputs, kept = self.scratch(layer, t)
        for new, old in ((inputs, kept_inputs), (step.k, kept.k), (step.u, kept.u), (step.g, kept.g)):
            if new.data_ptr() != old.data_ptr():
                old.copy_(new)

    def _states(self) -> list[torch.Tensor]:
        """What a request keeps between rounds besides the KV (the scratch is rewritten by every tree
        pass), and the end-of-prompt snapshot where there is one."""
        snaps = [self.snap_conv, self.snap_state] if self.snap_state is not None else []
        return [self.conv, self.state, *snaps]

    def copy_prefix(self, src: int, dst: int, length: int, from_snapshot: bool = False) -> None:
        """Also the linear layers' state at `length`: src's live state (its sequence's end) or its
        end-of-prompt snapshot."""
        super().copy_prefix(src, dst, length)
        conv, state = (self.snap_conv, self.snap_state) if from_snapshot else (self.conv, self.state)
        if from_snapshot or src != dst:
            self.conv[:, dst] = conv[:, src]
            self.state[:, dst] = state[:, src]

    def compact(self, start: torch.Tensor | None, nodes: torch.Tensor, length: torch.Tensor,
                moved: int | None = None) -> None:
        """Also advance each row's linear-layer state and conv tail along its own accepted path (the
        whole path: a state advances even where no KV moves); what rejected branches wrote to the
        scratch is never read."""
        super().compact(start, nodes, length, moved)
        advance_along(self.step, self.state, nodes, length)
        conv_tail_along(self.conv, self.inputs, nodes, length)


def _rows(value, lo: int, hi: int):
    """A cache attribute restricted to batch rows lo..hi-1 (dim 1 of every per-row tensor)."""
    if isinstance(value, torch.Tensor):
        return value[:, lo:hi]
    if isinstance(value, Step):
        return Step(*(t[:, lo:hi] for t in (value.k, value.u, value.g)))
    return value


def target_cache_bytes(cfg: Qwen3Config, capacity: int, nodes: int, elem: int, snapshots: bool = False) -> int:
    """Device memory a target's cache takes, plus the largest per-layer workspace of a tree pass that
    grows with the tree (the hybrid's [Hv, nodes, nodes] float32 matrices: a handful are live at once);
    `snapshots`: a hybrid's end-of-prompt state copy too."""
    kv = 2 * cfg.kv_layers * cfg.num_key_value_heads * capacity * cfg.head_dim * elem
    if not isinstance(cfg, Qwen35Config):
        return kv
    conv_tail = len(cfg.linear_layers) * elem * (cfg.linear_conv_kernel_dim - 1) * cfg.linear_conv_dim
    workspace = 6 * 4 * cfg.linear_num_value_heads * nodes * nodes
    state = (cfg.linear_state_bytes + conv_tail) * (2 if snapshots else 1)
    return kv + state + HybridCache.scratch_bytes(cfg, nodes, elem) + workspace


def target_cache(cfg: Qwen3Config, capacity: int, device: torch.device | str, dtype: torch.dtype,
                 batch: int = 1, nodes: int = 1, snapshots: bool = False, table: PageTable | None = None) -> KVCache:
    """The cache a target of this config needs; `nodes` is the largest tree pass it must hold;
    `snapshots`: a hybrid keeps each row's end-of-prompt state (prefix reuse); `table`: paged KV, one
    row per table row (capacity and batch then come from the table)."""
    if isinstance(cfg, Qwen35Config):
        return HybridCache(cfg, capacity, device, dtype, batch, nodes, snapshots, table)
    return KVCache(cfg.kv_layers, cfg.num_key_value_heads, cfg.head_dim, capacity, device, dtype, batch, table)
