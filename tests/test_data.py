import json
import os
import time

import datasets
import numpy as np
import pandas as pd
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from datasets.distributed import split_dataset_by_node

import trainer.data
from trainer.config import ConfigError, Training
from trainer.data import (
    PackedWindows,
    StreamingWindows,
    TokenDataLoader,
    build_dataloader,
    load_token_stream,
    stdlib_files,
    validation_windows,
)
from trainer.tokenizer import Tokenizer, build_tokenizer

DOCS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "Ünïcödé test — 日本語 and emoji 🚀 in a third document with some more words.",
    "Short fourth doc.",
    "Fifth: " + " ".join(str(i) for i in range(40)),
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return build_tokenizer("")


def expected_stream(tok: Tokenizer, docs: list[str]) -> np.ndarray:
    return np.array([i for d in docs for i in tok.encode(d, bos=tok.prepend_bos, eos=True)], dtype=np.int32)


def write_txt(folder, docs):
    os.makedirs(folder, exist_ok=True)
    for i, d in enumerate(docs):
        with open(os.path.join(folder, f"doc{i:03d}.txt"), "w", encoding="utf-8") as f:
            f.write(d)
    return str(folder)


def loader(windows, *, dp_rank=0, dp=1, lbs=2, gbs=8, seed=0, seq_len=None):
    return TokenDataLoader(
        windows, seq_len=seq_len or windows.seq_len, global_batch_size=gbs, local_batch_size=lbs,
        dp_rank=dp_rank, dp_degree=dp, seed=seed,
    )


def synthetic(n_windows: int, seq_len: int = 7) -> PackedWindows:
    """Windows whose first token is their index, so rows identify windows."""
    return PackedWindows(np.arange(n_windows * (seq_len + 1), dtype=np.int32), seq_len)


def window_ids(batches, seq_len: int = 7) -> list[int]:
    return [int(x) // (seq_len + 1) for inputs, _ in batches for x in inputs[:, 0]]


def global_batch(loaders) -> list[int]:
    """Window ids of one step: each rank's micro-batches, ranks in order."""
    return [w for ld in loaders for w in window_ids(ld.next_step())]


# ---- packing and formats -------------------------------------------------------------------


def test_packing_labels_shift_and_eos_between_documents(tok, tmp_path):
    tokens = load_token_stream(write_txt(tmp_path / "c", DOCS), tok, str(tmp_path / "cache"))
    np.testing.assert_array_equal(tokens, expected_stream(tok, DOCS))
    ends = np.cumsum([len(tok.encode(d, bos=False, eos=True)) for d in DOCS]) - 1
    assert (tokens[ends] == tok.eos_id).all() and (tokens == tok.eos_id).sum() == len(DOCS)

    windows = PackedWindows(tokens, seq_len=16)
    assert len(windows) == len(tokens) // 17
    ld = loader(windows, lbs=2, gbs=4)
    seen = []
    for _ in range(2):
        for inputs, labels in ld.next_step():
            assert inputs.dtype == labels.dtype == torch.int64 and inputs.shape == (2, 16)
            assert torch.equal(inputs[:, 1:], labels[:, :-1])
            seen += [tuple(r) for r in torch.cat([inputs, labels[:, -1:]], 1).tolist()]
    all_windows = {tuple(r) for r in tokens[: len(windows) * 17].reshape(-1, 17).tolist()}
    assert set(seen) <= all_windows and len(set(seen)) == min(8, len(windows))


def test_bos_prepended_only_when_distinct_from_eos(tok, tmp_path):
    with_bos = Tokenizer(tok.encoding, bos_id=100258, eos_id=100257, fingerprint="test-bos")
    tokens = load_token_stream(write_txt(tmp_path / "c", DOCS[:2]), with_bos, str(tmp_path / "cache"))
    first = [100258] + tok.encode(DOCS[0], bos=False, eos=False) + [100257]
    assert tokens[: len(first)].tolist() == first
    assert tokens[len(first)] == 100258


@pytest.mark.parametrize("fmt", ["txt-folder", "txt-glob", "jsonl", "json", "parquet"])
def test_each_format_gives_the_same_stream(tok, tmp_path, fmt):
    root = tmp_path / "data"
    os.makedirs(root)
    halves = [DOCS[:2], DOCS[2:]]
    if fmt.startswith("txt"):
        write_txt(root, DOCS)
        (root / "notes.md").write_text("ignored: not a supported extension")
        source = str(root) if fmt == "txt-folder" else str(root / "doc*.txt")
    elif fmt == "jsonl":
        for i, part in enumerate(halves):
            lines = [json.dumps({"text": d, "id": 7}) + "\n" for d in part]
            (root / f"part{i}.jsonl").write_text("".join(lines))
        source = str(root)
    elif fmt == "json":
        for i, part in enumerate(halves):
            (root / f"part{i}.json").write_text(json.dumps([{"text": d} for d in part]))
        source = str(root / "*.json")
    else:
        for i, part in enumerate(halves):
            pd.DataFrame({"text": part, "n": range(len(part))}).to_parquet(root / f"part{i}.parquet")
        source = str(root)
    tokens = load_token_stream(source, tok, str(tmp_path / "cache"))
    np.testing.assert_array_equal(tokens, expected_stream(tok, DOCS))


# ---- global order, dp independence, resume, epochs -----------------------------------------


@pytest.mark.parametrize("dp,lbs", [(1, 2), (2, 1), (2, 4), (4, 2), (8, 1)])
def test_union_over_dp_ranks_is_the_dp1_global_batch(dp, lbs):
    windows = synthetic(37)
    reference = loader(windows, dp=1, lbs=8, gbs=8)
    ranks = [loader(windows, dp_rank=r, dp=dp, lbs=lbs, gbs=8) for r in range(dp)]
    assert ranks[0].grad_accum_steps == 8 // (dp * lbs)
    for _ in range(6):  # crosses the epoch boundary at sample 37
        micro = ranks[0].next_step()
        assert len(micro) == ranks[0].grad_accum_steps and micro[0][0].shape == (lbs, 7)
        assert window_ids(micro) + global_batch(ranks[1:]) == window_ids(reference.next_step())


def test_exact_resume():
    windows = synthetic(50)
    run = loader(windows, dp=1, lbs=2, gbs=6)
    for _ in range(4):
        run.next_step()
    sd = run.state_dict()
    resumed = loader(windows, dp=1, lbs=2, gbs=6)
    resumed.load_state_dict(sd)
    for _ in range(12):  # past the end of epoch 0
        for (a, b), (c, d) in zip(run.next_step(), resumed.next_step()):
            assert torch.equal(a, c) and torch.equal(b, d)


def test_resume_with_different_dp_sees_the_same_global_samples():
    windows = synthetic(50)
    reference = loader(windows, dp=1, lbs=8, gbs=8)
    before = [loader(windows, dp_rank=r, dp=2, lbs=4, gbs=8) for r in range(2)]
    for _ in range(3):
        reference.next_step()
        for ld in before:
            ld.next_step()
    sd = before[1].state_dict()
    assert sd == before[0].state_dict()
    after = [loader(windows, dp_rank=r, dp=4, lbs=1, gbs=8) for r in range(4)]
    for ld in after:
        ld.load_state_dict(sd)
    for _ in range(5):
        assert global_batch(after) == window_ids(reference.next_step())


def test_epoch_wrap_re_permutes_deterministically():
    n = 20
    windows = synthetic(n)
    a, b = loader(windows, lbs=4, gbs=4, seed=3), loader(windows, lbs=4, gbs=4, seed=3)
    stream_a = [w for _ in range(15) for w in window_ids(a.next_step())]  # three epochs
    stream_b = [w for _ in range(15) for w in window_ids(b.next_step())]
    assert stream_a == stream_b
    epochs = [stream_a[i * n : (i + 1) * n] for i in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(n))
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != list(range(n))
    other_seed = loader(windows, lbs=4, gbs=4, seed=4)
    assert [w for _ in range(5) for w in window_ids(other_seed.next_step())] != epochs[0]


def test_load_state_dict_rejects_mismatches():
    windows = synthetic(30)
    sd = loader(windows, gbs=8, seed=0).state_dict()
    with pytest.raises(ConfigError, match="training.seed"):
        loader(windows, gbs=8, seed=1).load_state_dict(sd)
    with pytest.raises(ConfigError, match="training.global_batch_size"):
        loader(windows, gbs=4, seed=0).load_state_dict(sd)
    with pytest.raises(ConfigError, match="training.seq_len"):
        loader(synthetic(30, seq_len=3), gbs=8, seed=0).load_state_dict(sd)
    with pytest.raises(ConfigError, match="number of windows"):
        loader(synthetic(31), gbs=8, seed=0).load_state_dict(sd)


def test_batch_size_must_divide():
    with pytest.raises(ConfigError, match=r"training.global_batch_size \(6\).*training.local_batch_size \(2\)"
                       r".*parallelism.data_parallel_shard_degree \(2\) = 4.*e.g. 4"):
        loader(synthetic(30), dp=2, lbs=2, gbs=6)


def test_streaming_windows_pack_and_resume_with_same_dp(tok):
    docs = datasets.Dataset.from_dict({"text": DOCS * 4}).to_iterable_dataset(num_shards=4)

    def make(dp_rank, dp):
        shard = split_dataset_by_node(docs, rank=dp_rank, world_size=dp)
        stream = StreamingWindows(shard, tok, 8, "training.dataset")
        return TokenDataLoader(stream, seq_len=8, global_batch_size=4, local_batch_size=1, dp_rank=dp_rank,
                               dp_degree=dp, seed=0)

    run = make(1, 2)
    steps = [run.next_step() for _ in range(8)]  # several passes over this rank's two shards
    for micro in steps:
        assert len(micro) == 2
        for inputs, labels in micro:
            assert inputs.shape == (1, 8) and torch.equal(inputs[:, 1:], labels[:, :-1])
    resumed = make(1, 2)
    first = make(1, 2)
    first.next_step(), first.next_step(), first.next_step()
    resumed.load_state_dict(first.state_dict())
    for micro in steps[3:]:
        assert all(torch.equal(a, c) for (a, _), (c, _) in zip(micro, resumed.next_step()))
    with pytest.raises(ConfigError, match="parallelism.data_parallel_shard_degree"):
        make(0, 4).load_state_dict(first.state_dict())


# ---- build_dataloader: splits, errors, stdlib -----------------------------------------------


def cfg(**kw) -> Training:
    return Training(**{"seq_len": 16, "local_batch_size": 2, "global_batch_size": -1, "seed": 0, **kw})


def test_validation_split_is_held_out_of_training(tok, tmp_path):
    docs = [f"document {i}: " + " ".join(f"w{i}_{j}" for j in range(30)) for i in range(40)]
    data = write_txt(tmp_path / "c", docs)
    t = cfg(dataset_path=data)
    kw = dict(dp_rank=0, dp_degree=1, device="cpu", dump_folder=str(tmp_path / "out"), global_batch_size=2)
    train = build_dataloader(t, tok, **kw)
    val = build_dataloader(t, tok, **kw, split="validation")
    total = len(PackedWindows(expected_stream(tok, docs), 16))
    assert total > 40 and len(val.source) == validation_windows(total) == 4
    assert len(train.source) + len(val.source) == total
    assert train.source.stop == val.source.start
    first_val = val.next_step()
    val.reset()
    assert torch.equal(val.next_step()[0][0], first_val[0][0])

    other = write_txt(tmp_path / "v", docs[:3])
    val_path = build_dataloader(t, tok, **kw, split="validation", dataset_path=other)
    assert len(val_path.source) == len(PackedWindows(expected_stream(tok, docs[:3]), 16))


def test_build_dataloader_errors(tok, tmp_path):
    out = str(tmp_path / "out")
    kw = dict(dp_rank=0, dp_degree=2, device="cpu", dump_folder=out, global_batch_size=4)
    data = write_txt(tmp_path / "c", DOCS)
    with pytest.raises(ConfigError, match="training.global_batch_size"):
        build_dataloader(cfg(dataset_path=data), tok, **{**kw, "global_batch_size": 6})
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ConfigError, match="training.dataset_path .* matches no"):
        build_dataloader(cfg(dataset_path=str(tmp_path / "empty")), tok, **kw)
    with pytest.raises(ConfigError, match="training.dataset_path .* fewer than one window.*training.seq_len"):
        build_dataloader(cfg(dataset_path=write_txt(tmp_path / "tiny", ["hi"])), tok, **kw)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "a.jsonl").write_text('{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(ConfigError, match="training.dataset_path .* cannot read the json files"):
        build_dataloader(cfg(dataset_path=str(tmp_path / "bad")), tok, **kw)
    (tmp_path / "notext").mkdir()
    (tmp_path / "notext" / "a.jsonl").write_text('{"body": "ok"}\n')
    with pytest.raises(ConfigError, match="no 'text' field"):
        build_dataloader(cfg(dataset_path=str(tmp_path / "notext")), tok, **kw)
    small = write_txt(tmp_path / "small", DOCS[:2])
    assert 1 <= len(PackedWindows(expected_stream(tok, DOCS[:2]), 16)) < 10
    build_dataloader(cfg(dataset_path=small), tok, **kw)  # trains on everything, holds out nothing
    with pytest.raises(ConfigError, match="too few to hold out a validation split.*validation.dataset_path"):
        build_dataloader(cfg(dataset_path=small), tok, **kw, split="validation")


def test_stdlib_corpus_builds_and_is_cached(tok, tmp_path):
    files = stdlib_files(max_files=300)
    assert len(files) == 300 and files == sorted(files) and all(f.endswith(".py") for f in files)
    assert not any("site-packages" in f for f in stdlib_files())
    cache = str(tmp_path / "cache")
    start = time.perf_counter()
    tokens = load_token_stream("stdlib", tok, cache, max_files=300)
    first = time.perf_counter() - start
    start = time.perf_counter()
    again = load_token_stream("stdlib", tok, cache, max_files=300)
    second = time.perf_counter() - start
    np.testing.assert_array_equal(tokens, again)
    assert len(tokens) > 100_000
    assert (tokens == tok.eos_id).sum() == sum(os.path.getsize(f) > 0 for f in files)
    with open(files[0], encoding="utf-8") as f:
        head = f.read(200)
    assert tok.decode(tokens[:200]).startswith(head)
    assert second < first / 3, (first, second)
    assert [f for f in os.listdir(cache) if f.startswith("tokens-")]


def test_default_dataset_is_stdlib(tok, tmp_path, monkeypatch):
    # The whole corpus takes ~11 s to tokenize on 2 cores (docs/data.md); a prefix keeps this fast.
    real = trainer.data.stdlib_files
    monkeypatch.setattr(trainer.data, "stdlib_files", lambda max_files=None: real(200))
    t = cfg(seq_len=512, local_batch_size=4)
    ld = build_dataloader(t, tok, dp_rank=0, dp_degree=1, device="cpu", dump_folder=str(tmp_path),
                          global_batch_size=4)
    n = len(ld.source.tokens) // 513
    assert t.dataset == "stdlib" and n > 200 and len(ld.source) == n - validation_windows(n)
    inputs, labels = ld.next_step()[0]
    assert inputs.shape == (4, 512) and torch.equal(inputs[:, 1:], labels[:, :-1])


def _rank_worker(rank: int, world: int, store: str, data: str, dump: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    tok = build_tokenizer("")
    cache_was_there = []
    real = trainer.data.load_token_stream

    def spy(source, tokenizer, cache_dir, **kw):
        cache_was_there.append(any(f.startswith("tokens-") for f in os.listdir(cache_dir))
                               if os.path.isdir(cache_dir) else False)
        return real(source, tokenizer, cache_dir, **kw)

    trainer.data.load_token_stream = spy
    ld = build_dataloader(cfg(dataset_path=data, local_batch_size=1), tok, dp_rank=rank,
                          dp_degree=world, device="cpu", dump_folder=dump, global_batch_size=4)
    results[rank] = (cache_was_there, [torch.cat([x for x, _ in ld.next_step()]) for _ in range(3)])
    dist.destroy_process_group()


def test_two_ranks_rank0_tokenizes_first_and_batches_match_dp1(tok, tmp_path):
    docs = [f"doc {i} " + " ".join(str(i * j) for j in range(25)) for i in range(30)]
    data = write_txt(tmp_path / "c", docs)
    results = mp.Manager().dict()
    mp.spawn(_rank_worker, args=(2, str(tmp_path / "store"), data, str(tmp_path / "out"), results), nprocs=2)
    assert results[0][0] == [False] and results[1][0] == [True]
    ref = build_dataloader(cfg(dataset_path=data, local_batch_size=4), tok, dp_rank=0,
                           dp_degree=1, device="cpu", dump_folder=str(tmp_path / "out"), global_batch_size=4)
    for step in range(3):
        assert torch.equal(torch.cat([results[0][1][step], results[1][1][step]]), ref.next_step()[0][0])
