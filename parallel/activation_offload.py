"""The saved activations of the first blocks, held in host memory between forward and backward.

Why: a step's memory peaks as backward begins, with every block's saved activations alive, and
the first blocks' are the last backward reads. Copying them to pinned host memory as forward
makes them, and back a few blocks before backward needs them, frees their GPU memory across
the peak. The copies run on their own streams, on the GPU's copy engines, beside the compute;
the memory they free buys saving more in the other blocks (activation_checkpoint.per_block),
which is recompute removed. Megatron and Transformer Engine offer the same trade.

How: autograd's saved-tensor hooks (`torch.autograd.graph.saved_tensors_hooks`), pushed by a
forward pre-hook of the first offloaded block and popped by the pre-hook of the first block
after them, so nothing outside those blocks passes through them (the loss keeps autograd's
version check on the logits it overwrites). A block compiled on its own is one autograd node:
its pack hooks run as it saves its tensors after its graph, and its unpack hooks all at once
when its backward starts (torch 2.11 and 2.13), so a block is the unit of transfer. An eager
block without checkpointing works the same, op by op. An eager checkpointed block keeps its
tensors in checkpoint's own storage, out of these hooks' sight, and whole-model compile runs
them only after the whole graph: the run refuses both (trainer/run.py).

What moves: every storage of at least `MIN_BYTES` an offloaded block saves, once however many
of its views are saved, except those that stay alive anyway: its parameters' and buffers', and
its inputs after the first (the RoPE table every block reads). Each view comes back
with its own offset, size and strides: compiled code checks the strides of what it reads
(SDPA's log-sum-exp is saved non-contiguous). A DTensor (an eager tensor-parallel block) moves
its local shard and is wrapped again with its mesh, placements, shape and strides.

Streams (CUDA): a storage leaves on the offload stream once the compute stream has made it.
Its device memory is released in the compute stream's order: the compute stream waits for an
offloaded block's copies when it starts the block `2 x count + 2` blocks later (the last block
at the latest), and only then is the reference dropped. A copy takes about twice a block's
forward (3B, op SAC saving every matmul, H100: ~0.95 GiB over PCIe 5 against ~9 ms), so that
wait is normally long over. Freed instead with `record_stream`, the memory would stay
unusable until the caching allocator, on the host, saw the copy finish, and the host runs
ahead of the GPU by most of a forward: measured, the step's peak did not fall at all. A
storage comes back on the fetch stream into memory allocated on the compute stream, which
waits for it where it is unpacked, so that memory too is freed in the compute stream's order.
One never unpacked (a backward that raised or stopped early) is held until the next forward
starts and the compute stream has waited for the fetch stream. When a block's backward has
finished (a gradient hook on its input), the storages of the `FETCH_AHEAD` blocks below it
start back; a storage unpacked before its fetch began is fetched then and counted in
`late_fetches`. On a CPU there is no
stream and nothing to pin: a storage is copied to another host buffer and read back from it,
and released on the same schedule, which keeps the bookkeeping under test.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

MIN_BYTES = 1 << 20  # smaller storages (norms' rstd, masks) stay: a transfer each costs more than it frees
FETCH_AHEAD = 3  # blocks: a 3B op_all block's ~0.95 GiB take ~20 ms over PCIe 5, about its backward; the host runs ahead


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@dataclass
class _Stored:
    """One storage's bytes: on the host after offload, back on the device once fetched."""

    source: torch.Tensor | None  # uint8 over the device storage, held until released
    host: torch.Tensor | None  # uint8; pinned on a GPU
    offloaded: torch.cuda.Event | None
    device: torch.device
    back: torch.Tensor | None = None  # uint8 on `device`
    arrived: torch.cuda.Event | None = None


@dataclass(frozen=True)
class _View:
    """A saved tensor: a view of a stored storage."""

    stored: _Stored
    dtype: torch.dtype
    offset: int
    size: torch.Size
    stride: tuple[int, ...]


@dataclass(frozen=True)
class _DTensorView:
    """A saved DTensor: its local shard's view, and how to wrap it again."""

    local: _View
    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]


class ActivationOffload:
    """Offloads the saved activations of `blocks[:count]` to host memory (see the module docstring).

    `blocks` in forward order. Run each forward inside `scope()`, which also restores autograd's
    hooks if a forward fails halfway. `persistent` are tensors held for the whole run that a
    block reads like parameters (compute-dtype weight copies): saved, they stay where they are.
    """

    def __init__(self, blocks: nn.ModuleDict | Sequence[nn.Module], count: int, device: torch.device,
                 min_bytes: int = MIN_BYTES, persistent: Sequence[torch.Tensor] = ()) -> None:
        blocks = list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)
        if not 0 < count < len(blocks):
            raise ValueError(f"offload 1..{len(blocks) - 1} blocks, not {count}: the last block's backward comes first")
        self.count = count
        self.min_bytes = min_bytes  # tests lower it, to move a tiny model's storages
        self._n_blocks = len(blocks)
        self._release_lag = release_lag(count)
        self.bytes_offloaded = 0  # in the last forward
        self.late_fetches = 0  # storages unpacked before their fetch began, since the start
        self._device = device
        cuda = device.type == "cuda"
        self._offload_stream = torch.cuda.Stream(device) if cuda else None
        self._fetch_stream = torch.cuda.Stream(device) if cuda else None
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._active = False
        self._paused = False
        self._block: int | None = None
        self._kept: set[int] = set()  # storage addresses the current block saves but must not move
        self._persistent = {t.untyped_storage().data_ptr() for t in persistent}
        # The current block's stored storages by address (each holds its source until released,
        # long after the block, so an address cannot come back within it).
        self._by_address: dict[int, _Stored] = {}
        self._unreleased: dict[int, list[_Stored]] = {}  # per offloaded block, what still holds device memory
        self._to_fetch: dict[int, list[_Stored]] = {}  # per offloaded block, what has not started back
        self._unread: dict[int, _Stored] = {}  # fetched, not unpacked yet: their copies may still be running
        for index, block in enumerate(blocks):
            block.register_forward_pre_hook(self._pre_forward_hook(index))

    @contextlib.contextmanager
    def scope(self, offload: bool = True):
        """Around one forward: pops the pack hooks if the forward ended inside an offloaded block.
        `offload=False` moves nothing: for a forward whose graph is freed unread (validation's,
        which runs with grad mode on so that compiled regions are not compiled twice)."""
        self._paused = not offload
        try:
            yield
        finally:
            self._paused = False
            self._deactivate()
            self._release(everything=True)

    def _pre_forward_hook(self, index: int):
        # Eager, outside the block's graph under per-block compile: torch.compiler.disable keeps
        # dynamo from tracing it with the module call (checked on torch 2.11 and 2.13).
        @torch.compiler.disable
        def hook(module: nn.Module, args: tuple) -> None:
            if self._paused or not torch.is_grad_enabled():
                return
            if index == 0:
                self.bytes_offloaded = 0
                self._to_fetch.clear()  # a forward without backward left these
                self._drop_unread()
            if index < self.count:
                self._enter_block(index, module, args)
            else:
                self._deactivate()
            self._release(up_to=index, everything=index == self._n_blocks - 1)
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and x.requires_grad and index > 0:
                x.register_hook(self._finished_hook(index))

        return hook

    def _enter_block(self, index: int, module: nn.Module, args: tuple) -> None:
        if not self._active:
            self._hooks.__enter__()
            self._active = True
        self._block = index
        self._by_address = {}
        self._to_fetch[index] = []
        self._unreleased[index] = []
        # Alive anyway: the block's parameters and buffers, the inputs after the first, which
        # every block shares (the RoPE table), and the persistent tensors.
        shared = [*module.parameters(), *module.buffers(), *(a for a in args[1:] if isinstance(a, torch.Tensor))]
        self._kept = {_local(t).untyped_storage().data_ptr() for t in shared} | self._persistent

    def _deactivate(self) -> None:
        if self._active:
            self._hooks.__exit__(None, None, None)
            self._active = False
        self._block = None
        self._by_address = {}

    def _release(self, up_to: int = -1, everything: bool = False) -> None:
        """Drop the device memory of every offloaded block that started `_release_lag` or more
        blocks before block `up_to` (or of all), once the compute stream has waited for its copies."""
        for block in [b for b in self._unreleased if everything or b + self._release_lag <= up_to]:
            stored = self._unreleased.pop(block)
            if stored and stored[-1].offloaded is not None:  # one stream: the last copy ends after the others
                torch.cuda.current_stream(self._device).wait_event(stored[-1].offloaded)
            for item in stored:
                item.source = None

    def _drop_unread(self) -> None:
        """Free what the last backward fetched but never read, once its copies are done."""
        if self._unread and self._fetch_stream is not None:
            torch.cuda.current_stream(self._device).wait_stream(self._fetch_stream)
        self._unread.clear()

    def _finished_hook(self, index: int):
        def hook(grad: torch.Tensor) -> None:
            for block in range(max(index - FETCH_AHEAD, 0), index):
                for stored in self._to_fetch.pop(block, ()):
                    self._fetch(stored)

        return hook

    def _pack(self, t: torch.Tensor) -> torch.Tensor | _View | _DTensorView:
        if self._block is None:
            return t
        if isinstance(t, DTensor):  # an eager tensor-parallel block saves DTensors: move the shard
            with torch.no_grad():  # the shard only, no autograd node for it
                local = self._pack(t.to_local())
            if isinstance(local, torch.Tensor):
                return t
            return _DTensorView(local, t.device_mesh, tuple(t.placements), t.shape, t.stride())
        if type(t) is not torch.Tensor or t.device != self._device or t.is_conj() or t.is_neg():
            return t  # a rebuilt view would lose a conjugate or negative bit
        storage = t.untyped_storage()
        address = storage.data_ptr()
        if storage.nbytes() < self.min_bytes or address in self._kept:
            return t
        stored = self._by_address.get(address)
        if stored is None:
            stored = self._by_address[address] = self._offload(storage)
            self._unreleased[self._block].append(stored)
            self._to_fetch[self._block].append(stored)
            self.bytes_offloaded += storage.nbytes()
        return _View(stored, t.dtype, t.storage_offset(), t.size(), t.stride())

    def _unpack(self, packed: torch.Tensor | _View | _DTensorView) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _DTensorView):
            return DTensor.from_local(self._unpack(packed.local), packed.mesh, packed.placements,
                                      shape=packed.shape, stride=packed.stride, run_check=False)
        stored = packed.stored
        if stored.back is None:
            self.late_fetches += 1
            self._fetch(stored)
        if stored.arrived is not None:
            torch.cuda.current_stream(self._device).wait_event(stored.arrived)
        self._unread.pop(id(stored), None)  # from here freed in the compute stream's order
        view = torch.empty(0, dtype=packed.dtype, device=self._device)
        return view.set_(stored.back.untyped_storage(), packed.offset, packed.size, packed.stride)

    def _offload(self, storage: torch.UntypedStorage) -> _Stored:
        source = _bytes_of(storage)
        if self._offload_stream is None:
            return _Stored(source=source, host=source.clone(), offloaded=None, device=self._device)
        host = torch.empty(source.numel(), dtype=torch.uint8, pin_memory=True)
        self._offload_stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self._offload_stream):
            host.copy_(source, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._offload_stream)
        return _Stored(source=source, host=host, offloaded=done, device=self._device)

    def _fetch(self, stored: _Stored) -> None:
        """Start `stored` back to the device; its host buffer is released (the pinned-memory
        cache keeps it from reuse until the copy is done)."""
        if stored.back is not None:
            return
        host, stored.host = stored.host, None
        self._unread[id(stored)] = stored
        if self._fetch_stream is None:
            stored.back = host
            return
        compute = torch.cuda.current_stream(self._device)
        back = torch.empty(host.numel(), dtype=torch.uint8, device=self._device)  # in the compute stream's pool
        self._fetch_stream.wait_stream(compute)  # whatever last used this memory is done
        self._fetch_stream.wait_event(stored.offloaded)
        with torch.cuda.stream(self._fetch_stream):
            back.copy_(host, non_blocking=True)
            stored.arrived = torch.cuda.Event()
            stored.arrived.record(self._fetch_stream)
        stored.back = back


def release_lag(count: int) -> int:
    """How many blocks after an offloaded block the block is whose start releases its device
    memory. The offloaded blocks' copies run one after another on one stream, each about two
    blocks' forward, so the last of them ends about 2 x count + 1 blocks into forward: waiting
    for any of them from then on costs nothing. (A lag per block, about 2b + 3 for block b,
    would release the first blocks sooner; not measured.)"""
    return 2 * count + 2


def most_useful_count(n_blocks: int) -> int:
    """The most blocks worth offloading: with more, forward holds more blocks at once before it
    releases the offloaded ones (2 x count + 2, `release_lag`) than the n_blocks - count it
    ends with, so each further block frees less than it moves."""
    return max((n_blocks - 2) // 3, 0)


def blocks_on_device_in_forward(count: int, n_blocks: int) -> list[list[int]]:
    """For each block in forward order, the blocks whose saved activations are on the device
    while it runs, itself included: with `count` offloaded, the schedule the dry run counts
    (parallel/memory.py). Until the offloaded blocks are released, forward holds them too; the
    last block releases whatever is left."""
    lag = release_lag(count)
    return [[b for b in range(j + 1) if not (b < count and (b + lag <= j or j == n_blocks - 1))]
            for j in range(n_blocks)]


def _local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's local tensor (a DTensor's shard), whose storage a block saves."""
    return p.to_local() if isinstance(p, DTensor) else p
