"""Activation offload (parallel/activation_offload.py): the saved activations of the first blocks
held in host memory from forward to backward.

On a CPU a storage is copied to another host buffer and read back from it, on the schedule a
GPU uses (released a fixed number of blocks later, fetched `FETCH_AHEAD` blocks ahead), so
these tests check everything but the streams: training with offload is bit for bit training
without it (eager, and compiled per block with inductor under every checkpointing kind, where
compiled code checks the strides of what it reads back); each offloaded storage's memory is
released by the end of forward; only the offloaded blocks' saved tensors pass through the
hooks, never a parameter; every fetch starts before backward needs it; a failed forward leaves
no hook behind; the config refuses what the hooks cannot see, in one line; the dry run counts
the offloaded activations out. The streams were checked on an H100 (docs/performance.md).
Multi-rank parity (dp 2, tp 2 with DTensor activations, compiled blocks) runs in the shared
2-process launch (tests/conftest.py's `world2`).
"""

import dataclasses
import json

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from tests.test_compile_parity import AC_MODES, STRATEGIES
from tests.test_parallel_parity import BASE, COMPILED_TOLERANCE, TOLERANCE, assert_close_runs

N_LAYERS, OFFLOADED, VOCAB, SEQ = 4, 2, 512, 64
OFFLOAD = ["--activation_checkpoint.offload_blocks", "1", "--offload-all-sizes"]
DP2 = ["--parallelism.tensor_parallel_degree", "1"]
TP2_SP = ["--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel", "true",
          "--parallelism.enable_loss_parallel", "true"]
# Trained in the 2-process launch shared with the parity tests (the `world2` fixture, tests/conftest.py).
OFFLOAD_WORLD2 = {
    "dp 2, eager": DP2 + OFFLOAD,
    "tp 2, sequence and loss parallel, eager (DTensor activations)": TP2_SP + OFFLOAD,
    "dp 2, blocks compiled, op SAC": STRATEGIES["blocks"] + DP2 + AC_MODES["sel_op"] + OFFLOAD,
}


def _model(kind: str, compiled: bool, n_layers: int = N_LAYERS):
    from models.llama3.args import flavor_args
    from models.llama3.model import Transformer
    from parallel.activation_checkpoint import apply_activation_checkpointing

    args = dataclasses.replace(flavor_args("tinymodel", vocab_size=VOCAB, max_seq_len=SEQ), n_layers=n_layers)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    apply_activation_checkpointing(model.layers, "per_block", "op", per_block=f"{kind}:{n_layers}")
    if compiled:
        for block in model.layers.values():
            block.compile(backend="inductor", fullgraph=True, dynamic=False)
    return model


class _Watched:
    """An ActivationOffload whose pack hook and offloads are observed."""

    def __init__(self, model, count: int = OFFLOADED):
        from parallel.activation_offload import ActivationOffload

        self.offload = ActivationOffload(model.layers, count, torch.device("cpu"), min_bytes=0)
        self.packed_in: list[int | None] = []  # the block each pack ran in
        self.sources: list[StorageWeakRef] = []  # each offloaded storage
        self.source_blocks: list[int] = []  # the block that saved it
        self.parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.offloaded_addresses: list[int] = []
        pack, offload = self.offload._pack, self.offload._offload

        def watched_pack(t):
            self.packed_in.append(self.offload._block)
            return pack(t)

        def watched_offload(storage):
            self.sources.append(StorageWeakRef(storage))
            self.source_blocks.append(self.offload._block)
            self.offloaded_addresses.append(storage.data_ptr())
            return offload(storage)

        self.offload._hooks = torch.autograd.graph.saved_tensors_hooks(watched_pack, self.offload._unpack)
        self.offload._offload = watched_offload


def _train(kind: str, compiled: bool, offload: bool, steps: int = 3):
    """Losses and final gradients of a few SGD steps; with offload, what was seen each step."""
    model = _model(kind, compiled)
    watched = _Watched(model) if offload else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1))
    losses, seen = [], []
    for _ in range(steps):
        optimizer.zero_grad()
        if watched:
            watched.sources.clear()
            with watched.offload.scope():
                logits = model(tokens[:, :-1])
            seen.append({"alive after forward": sum(not ref.expired() for ref in watched.sources),
                         "offloaded": len(watched.sources)})
        else:
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return losses, grads, seen, watched


@pytest.mark.parametrize("kind, compiled", [("none", False), ("none", True), ("op", True), ("op_all", True),
                                            ("full", True)])
def test_training_with_offload_is_bit_for_bit_training_without(kind, compiled):
    losses, grads, _, _ = _train(kind, compiled, offload=False)
    off_losses, off_grads, seen, watched = _train(kind, compiled, offload=True)
    assert losses == off_losses
    for name, grad in grads.items():
        assert torch.equal(grad, off_grads[name]), name
    assert losses[-1] < losses[0]
    offload = watched.offload
    assert all(step["offloaded"] > 0 for step in seen), seen
    assert all(step["alive after forward"] == 0 for step in seen), seen  # device memory released
    assert offload.late_fetches == 0  # every fetch began a block or more before its backward
    assert set(watched.packed_in) == set(range(OFFLOADED))  # only the offloaded blocks' tensors
    assert not watched.parameters & set(watched.offloaded_addresses)
    assert offload.bytes_offloaded > 0 and not offload._unreleased and not offload._to_fetch and not offload._unread


def test_weight_copies_stay_where_they_are():
    """With compute_weight_copies a block saves the bf16 weight copies it read, which are held for
    the whole run: the offload leaves them in place (moving them would free nothing), moves the
    rest, and training is bit for bit training without offload."""
    from parallel.activation_offload import ActivationOffload
    from parallel.data_parallel import apply_compute_dtype, compact_gradients

    def train(offload: bool):
        model = _model("none", compiled=False)
        apply_compute_dtype(model, torch.bfloat16)
        held = compact_gradients(model, torch.bfloat16, keep_copies=True)
        off = ActivationOffload(model.layers, OFFLOADED, torch.device("cpu"), min_bytes=0, persistent=held.copies())
        moved = []
        offload_storage = off._offload
        off._offload = lambda storage: moved.append(storage.data_ptr()) or offload_storage(storage)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
        losses = []
        for _ in range(2):
            held.refresh_copies()
            with off.scope(offload):
                logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
            losses.append(loss.item())
            for group in held.materialized([p for p in model.parameters() if p.grad is not None]):
                optimizer.step()
        copies = {c.untyped_storage().data_ptr() for c in held.copies()}
        return losses, moved, copies

    losses, moved, copies = train(offload=True)
    assert moved and not copies & set(moved)
    assert losses == train(offload=False)[0]


def test_a_forward_that_fails_leaves_no_hook_behind():
    model = _model("none", compiled=False)
    watched = _Watched(model)

    def fail(module, args, output):  # after offloaded block 1: its hooks are still pushed
        raise RuntimeError("boom")

    handle = model.layers["1"].register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="boom"):
        with watched.offload.scope():
            model(torch.zeros(1, SEQ, dtype=torch.long))
    handle.remove()
    packed = len(watched.packed_in)
    x = torch.randn(8, 8, requires_grad=True)
    (x * x).sum().backward()  # saves x: would pass through a hook left pushed
    assert len(watched.packed_in) == packed
    assert not watched.offload._unreleased


@pytest.mark.parametrize("name", list(OFFLOAD_WORLD2))
def test_two_processes_with_offload_match_one_without(world2, references, name):
    records = world2[" ".join(OFFLOAD_WORLD2[name])]
    assert all(r["offload_gib"] > 0 for r in records), name
    assert_close_runs(references[8], records, name, COMPILED_TOLERANCE if "compiled" in name else TOLERANCE)
    if "compiled" in name:
        assert records[-1]["recompiles_after_warmup"] == 0, name


@pytest.mark.parametrize("overrides, needle", [
    (["--activation_checkpoint.offload_blocks", "2"], "offload_blocks = 2: use 0..1"),
    (["--activation_checkpoint.offload_blocks", "-1"], "offload_blocks = -1: use 0..1"),
    (["--activation_checkpoint.offload_blocks", "1", "--compile.enable", "true", "--compile.strategy", "model"],
     "offload_blocks needs compile.strategy = 'blocks' or compile.enable = false"),
    (["--activation_checkpoint.offload_blocks", "1", "--activation_checkpoint.mode", "full"],
     "offload_blocks = 1 with eager checkpointed blocks"),
    (["--activation_checkpoint.offload_blocks", "1", "--activation_checkpoint.mode", "full", "--compile.enable",
      "true", "--compile.strategy", "blocks", "--compile.backend", "eager"],
     "offload_blocks = 1 with eager checkpointed blocks"),
])
def test_config_mistakes_are_one_line(monkeypatch, capsys, tmp_path, overrides, needle):
    from tests.test_run_guards import _check_only

    code, _, err = _check_only(monkeypatch, capsys, tmp_path, *overrides)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and needle in lines[0], err


@pytest.mark.parametrize("overrides", [
    ["--activation_checkpoint.mode", "per_block", "--activation_checkpoint.per_block", "none:1,full:1"],
    ["--activation_checkpoint.mode", "full", "--compile.enable", "true", "--compile.strategy", "blocks"],
])
def test_what_the_hooks_can_see_is_accepted(monkeypatch, capsys, tmp_path, overrides):
    from tests.test_run_guards import _check_only

    code, _, err = _check_only(monkeypatch, capsys, tmp_path, "--activation_checkpoint.offload_blocks", "1", *overrides)
    assert code == 0, err


def _plan_3b_op_all(offload_blocks: int):
    """The dry run of 3B saving every matmul (op_all:28), local batch 2, one GPU."""
    from trainer.config import load_config
    from trainer.dry_run import plan

    argv = ["--job.config_file", "train_configs/llama3_3b.toml", "--comm.mode", "fake_backend",
            "--training.local_batch_size", "2", "--compile.enable", "true",
            "--activation_checkpoint.mode", "per_block", "--activation_checkpoint.per_block", "op_all:28",
            "--activation_checkpoint.offload_blocks", str(offload_blocks)]
    return plan(load_config(argv), 1)


def _op_all_3b_blocks(n: int) -> int:
    """The activations `n` such blocks save at 16,384 tokens (0.947 GiB each)."""
    from models.llama3.args import flavor_args
    from models.llama3.memory import activation_bytes
    from parallel.memory import ActivationInputs

    inputs = ActivationInputs(tokens=16_384, tp=1, sequence_parallel=False, loss_parallel=False, compute_bytes=2,
                              compiled=True, fused_norm=False)  # compiled counts read no norm kernel
    return activation_bytes(flavor_args("3B", vocab_size=128_256, max_seq_len=8192), inputs, ["op_all"] * n).blocks


def test_dry_run_counts_the_offloaded_blocks_out():
    """Offloading 5 blocks takes exactly their activations off every phase that holds activations."""
    kept, offloaded, five = _plan_3b_op_all(0).memory, _plan_3b_op_all(5).memory, _op_all_3b_blocks(5)
    assert kept.activation_total - offloaded.activation_total == five
    for before, after in zip(kept.phases, offloaded.phases):
        holds_activations = "activations" in before.parts
        assert before.total - after.total == (five if holds_activations else 0), before.name
    assert offloaded.peak.name == "backward: the head"


def test_forward_with_many_blocks_offloaded_is_counted_before_their_release():
    """12 of 28 blocks offloaded: each is released 26 blocks after it starts, so block 25 runs
    with blocks 0-25 on the device, 26 blocks' activations against the 16 left at the end of
    forward, and before the head's input and cast copy exist. The dry run shows that phase,
    and it is the peak."""
    kept, many = _plan_3b_op_all(0), _plan_3b_op_all(12).memory
    head = kept.units[-1] if kept.units[-1].name != "root" else kept.units[-2]
    all_but_head = kept.memory.activation_total - kept.memory.activations.outside_blocks - head.compute_copies
    phase = next(p for p in many.phases if p.name == "forward: offloaded blocks not yet released")
    assert phase.parts["activations"] == all_but_head - _op_all_3b_blocks(2)
    assert many.peak is phase
    few = _plan_3b_op_all(8).memory  # 19 blocks at most before the last block, 20 at the end of forward
    assert all(p.name != phase.name for p in few.phases)


@pytest.mark.parametrize("n_layers, count", [(8, 1), (9, 2), (12, 3)])
def test_device_memory_is_released_on_the_counted_schedule(n_layers, count):
    """What the dry run assumes (blocks_on_device_in_forward) is what the hooks do: at each
    block's start, the offloaded blocks whose storages are still alive are the ones it lists."""
    from parallel.activation_offload import blocks_on_device_in_forward

    model = _model("none", compiled=False, n_layers=n_layers)
    watched = _Watched(model, count)
    seen = []

    def record(module, args):  # registered after the offload's hook: sees what it left
        seen.append(sorted({b for b, ref in zip(watched.source_blocks, watched.sources) if not ref.expired()}))

    for block in model.layers.values():
        block.register_forward_pre_hook(record)
    with watched.offload.scope():
        model(torch.randint(0, VOCAB, (2, SEQ)))
    expected = [[b for b in alive if b < count and b < j] for j, alive in
                enumerate(blocks_on_device_in_forward(count, n_layers))]
    assert seen == expected
    assert any(len(alive) < min(j, count) for j, alive in enumerate(seen[:-1]))  # released before the last block


def test_validation_forward_moves_nothing():
    model = _model("none", compiled=False)
    watched = _Watched(model)
    with watched.offload.scope(offload=False):
        model(torch.randint(0, VOCAB, (2, SEQ)))
    assert watched.packed_in == [] and watched.sources == [] and watched.offload.bytes_offloaded == 0
    with watched.offload.scope():  # the next training forward offloads again
        model(torch.randint(0, VOCAB, (2, SEQ)))
    assert watched.sources


def test_what_backward_never_reads_is_held_until_the_next_forward():
    """A backward that stops early (here at block 1's input) fetches block 0's storages and
    never unpacks them: on a GPU their copies may still run, so they are kept until the next
    forward starts (after the compute stream has waited for the fetch stream)."""
    model = _model("none", compiled=False)
    watched = _Watched(model)
    inputs = []
    model.layers["1"].register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    with watched.offload.scope():
        loss = model(tokens).square().mean()
    torch.autograd.grad(loss, inputs)
    assert watched.offload._unread  # fetched when block 1's backward ended, never read
    with watched.offload.scope():
        model(tokens)
    assert not watched.offload._unread


def test_a_storage_is_fetched_once():
    model = _model("none", compiled=False)
    offload = _Watched(model).offload
    stored = offload._offload(torch.ones(4).untyped_storage())
    offload._fetch(stored)
    back = stored.back
    offload._fetch(stored)  # e.g. a late fetch, then the block's turn in the fetch-ahead
    assert back is not None and stored.back is back


def test_conjugate_and_negative_views_stay():
    """A view rebuilt from its storage would lose the bit: such tensors are not moved."""
    model = _model("none", compiled=False)
    offload = _Watched(model).offload
    offload._enter_block(0, model.layers["0"], (torch.randn(2, SEQ, 64),))
    try:
        z = torch.randn(8, dtype=torch.complex64)
        conj = z.conj()
        neg = conj.imag  # the imaginary part of a conjugate view is a negative view
        assert conj.is_conj() and neg.is_neg()
        assert offload._pack(conj) is conj and offload._pack(neg) is neg
        assert not isinstance(offload._pack(z), torch.Tensor)  # without the bits it moves
    finally:
        offload._deactivate()


def _validate_with_offload(rank, world_size, dump, corpus, out):
    from trainer.config import load_config
    from trainer.run import resolve_run
    from trainer.trainer import Trainer

    cfg = load_config(BASE + ["--training.dataset_path", corpus, "--job.dump_folder", dump, "--training.steps", "2",
                              "--activation_checkpoint.offload_blocks", "1", "--validation.enable",
                              "--validation.freq", "1", "--validation.steps", "1"])
    trainer = Trainer(resolve_run(cfg, world_size))
    offload, moved = trainer.activation_offload, {"train": 0, "validation": 0}
    phase, validate, offload_storage = ["train"], trainer.validate, offload._offload

    def validate_watched():
        phase[0] = "validation"
        try:
            return validate()
        finally:
            phase[0] = "train"

    def offload_watched(storage):
        moved[phase[0]] += 1
        return offload_storage(storage)

    trainer.validate, offload._offload, offload.min_bytes = validate_watched, offload_watched, 0
    trainer.train()
    trainer.close()
    with open(out, "w") as f:
        json.dump(moved, f)


def test_validation_in_training_moves_nothing(tmp_path, corpus):
    from tests.dist_utils import run_distributed

    out = tmp_path / "moved.json"
    run_distributed(_validate_with_offload, 1, str(tmp_path / "dump"), corpus, str(out))
    moved = json.loads(out.read_text())
    assert moved["train"] > 0 and moved["validation"] == 0, moved
