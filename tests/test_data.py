import json
import os
import re
import threading
import time

import datasets
import numpy as np
import pandas as pd
import pytest
import torch
import torch.multiprocessing as mp
from datasets.distributed import split_dataset_by_node

import trainer.data.documents
import trainer.data.ingest
from trainer.config import ConfigError, Training
from trainer.data import TokenDataLoader, build_dataloader, validation_windows
from trainer.data.build import open_store, parse_mixture
from trainer.data.documents import plan_pieces, read_documents, stdlib_files
from trainer.data.lock import build_once
from trainer.data.order import MixtureSchedule, SeededPermutation
from trainer.data.sources import StoreWindows, StreamWindows
from trainer.data.store import TokenFileWriter, TokenStore
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
    return np.array([i for d in docs for i in tok.encode(d, bos=tok.prepend_bos, eos=True)], dtype=np.int64)


def write_txt(folder, docs):
    os.makedirs(folder, exist_ok=True)
    for i, d in enumerate(docs):
        with open(os.path.join(folder, f"doc{i:03d}.txt"), "w", encoding="utf-8") as f:
            f.write(d)
    return str(folder)


def tokens_of(source, tok, cache, **kw):
    store = open_store(source, tok, str(cache), key="training.dataset_path", num_proc=kw.pop("num_proc", 1))
    return store.read(0, len(store))


def synthetic(n_windows: int, seq_len: int = 7, seed: int = 0, name: str = "mem", offset: int = 0) -> StoreWindows:
    """Windows whose first token is their index (+ offset), so rows identify windows."""
    tokens = np.arange(offset * (seq_len + 1), (offset + n_windows) * (seq_len + 1), dtype=np.int32)
    return StoreWindows(name, TokenStore([(name, tokens)]), seq_len, seed=seed)


def loader(windows, *, dp_rank=0, dp=1, lbs=2, gbs=8, seed=0, weights=None, allow=False):
    sources = windows if isinstance(windows, list) else [windows]
    return TokenDataLoader(
        sources, weights, seq_len=sources[0].seq_len, global_batch_size=gbs, local_batch_size=lbs,
        dp_rank=dp_rank, dp_degree=dp, seed=seed, allow_data_change=allow,
    )


def window_ids(batches, seq_len: int = 7) -> list[int]:
    return [int(x) // (seq_len + 1) for inputs, _ in batches for x in inputs[:, 0]]


def global_batch(loaders) -> list[int]:
    """Window ids of one step: each rank's micro-batches, ranks in order."""
    return [w for ld in loaders for w in window_ids(ld.next_step())]


# ---- packing and formats -------------------------------------------------------------------


def test_packing_labels_shift_and_eos_between_documents(tok, tmp_path):
    tokens = tokens_of(write_txt(tmp_path / "c", DOCS), tok, tmp_path / "cache")
    np.testing.assert_array_equal(tokens, expected_stream(tok, DOCS))
    ends = np.cumsum([len(tok.encode(d, bos=False, eos=True)) for d in DOCS]) - 1
    assert (tokens[ends] == tok.eos_id).all() and (tokens == tok.eos_id).sum() == len(DOCS)

    store = TokenStore([("t", tokens)])
    windows = StoreWindows("t", store, 16, seed=0)
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
    tokens = tokens_of(write_txt(tmp_path / "c", DOCS[:2]), with_bos, tmp_path / "cache")
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
    np.testing.assert_array_equal(tokens_of(source, tok, tmp_path / "cache"), expected_stream(tok, DOCS))


def test_big_files_are_cut_into_pieces_that_read_the_same_documents(tmp_path, monkeypatch):
    docs = [f"document {i} " + "x" * (i % 50) for i in range(3000)]
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    pq_path = tmp_path / "big.parquet"
    pd.DataFrame({"text": docs}).to_parquet(pq_path, row_group_size=100)
    monkeypatch.setattr(trainer.data.documents, "PIECE_BYTES_MIN", 4096)
    for f in (path, pq_path):
        pieces = plan_pieces([str(f)])
        assert len(pieces) > 5
        assert [d for p in pieces for d in read_documents(p)] == docs


# ---- bad input: one line naming the file ----------------------------------------------------


@pytest.mark.parametrize("content,match", [
    (b'{"text": "ok"}\n{"text": "caf\xe9"}\n', r"bad.jsonl', line 2: is not UTF-8 \(byte 0xe9"),
    (b'{"text": "ok"}\n{"text": 123}\n', r"bad.jsonl', line 2: 'text' holds int '123', not a string"),
    (b'{"text": "ok"}\n{"text": broken\n', r"bad.jsonl', line 2: is not valid JSON"),
    (b'{"body": "ok"}\n', r"bad.jsonl', line 1: record has no 'text' field \(found \['body'\]\)"),
])
def test_bad_documents_name_the_file_and_line(tok, tmp_path, content, match):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "bad.jsonl").write_bytes(content)
    for streaming in (False, True):
        t = cfg(dataset_path=str(tmp_path / "bad"), dataset_streaming=streaming)
        with pytest.raises(ConfigError, match=match) as e:
            build_dataloader(t, tok, **kw(tmp_path)).next_step()
        assert "\n" not in str(e.value)


def test_bad_text_file_names_the_file(tok, tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_bytes(b"fine\xff\xfe")
    with pytest.raises(ConfigError, match=r"a.txt' \(byte 4\): is not UTF-8 text"):
        build_dataloader(cfg(dataset_path=str(tmp_path / "t")), tok, **kw(tmp_path))


# ---- global order, dp independence, resume, epochs -----------------------------------------


def test_seeded_permutation_is_a_bijection_keyed_by_seed_and_epoch():
    for n in (1, 2, 3, 7, 64, 65, 1000, 4099):
        assert sorted(SeededPermutation(n, 0, 0, 0)(np.arange(n)).tolist()) == list(range(n))
    perms = {key: SeededPermutation(1000, *key)(np.arange(1000)).tolist() for key in [(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1)]}
    assert len({tuple(p) for p in perms.values()}) == 4
    idx = np.array([999, 3, 500])
    assert SeededPermutation(1000, 0, 0, 0)(idx).tolist() == [perms[(0, 0, 0)][i] for i in idx]


def test_seeded_permutation_shuffles_well():
    """What docs/data.md states: consecutive samples are unrelated, positions uniform."""
    n = 200_003
    p = SeededPermutation(n, 0, 0, 0)(np.arange(n)).astype(np.float64)
    assert abs(np.corrcoef(p[:-1], p[1:])[0, 1]) < 0.01  # lag-1 correlation
    assert abs(np.corrcoef(np.arange(n), p)[0, 1]) < 0.01  # no drift with position
    assert abs(np.abs(np.diff(p)).mean() / n - 1 / 3) < 0.01  # mean jump of a uniform shuffle: n/3
    first_tenth = np.histogram(p[: n // 10], bins=10, range=(0, n))[0]
    assert first_tenth.min() > 0.9 * first_tenth.mean()  # early samples cover the whole corpus


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
    windows = synthetic(n, seed=3)
    a, b = loader(windows, lbs=4, gbs=4, seed=3), loader(windows, lbs=4, gbs=4, seed=3)
    stream_a = [w for _ in range(15) for w in window_ids(a.next_step())]  # three epochs
    stream_b = [w for _ in range(15) for w in window_ids(b.next_step())]
    assert stream_a == stream_b
    epochs = [stream_a[i * n : (i + 1) * n] for i in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(n))
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != list(range(n))
    other_seed = loader(synthetic(n, seed=4), lbs=4, gbs=4, seed=4)
    assert [w for _ in range(5) for w in window_ids(other_seed.next_step())] != epochs[0]


def test_load_state_dict_rejects_mismatches():
    windows = synthetic(30)
    run = loader(windows, gbs=8, seed=0)
    run.next_step()
    sd = run.state_dict()
    with pytest.raises(ConfigError, match="training.seed"):
        loader(windows, gbs=8, seed=1).load_state_dict(sd)
    with pytest.raises(ConfigError, match="training.global_batch_size"):
        loader(windows, gbs=4, seed=0).load_state_dict(sd)
    with pytest.raises(ConfigError, match="training.seq_len"):
        loader(synthetic(30, seq_len=3), gbs=8, seed=0).load_state_dict(sd)
    with pytest.raises(ConfigError, match=r"trained on mem \(240 tokens, 30 windows.*reads mem \(248 tokens, 31"):
        loader(synthetic(31), gbs=8, seed=0).load_state_dict(sd)


def test_same_window_count_on_other_data_needs_allow_data_change():
    sd = loader(synthetic(30), gbs=8).state_dict()
    other = synthetic(30, offset=1000)  # same size and window count, other tokens
    with pytest.raises(ConfigError, match="first tokens.*--checkpoint.allow_data_change to continue from sample 0"):
        loader(other, gbs=8).load_state_dict(sd)
    moved = synthetic(30, name="/new/place")  # same tokens elsewhere: fine
    loader(moved, gbs=8).load_state_dict(sd)
    allowed = loader(other, gbs=8, allow=True)
    sd["samples_consumed"] = 16
    allowed.load_state_dict(sd)
    assert allowed.samples_consumed == 16


def test_old_in_memory_loader_state_is_refused_unless_allowed():
    old = {"samples_consumed": 24, "seed": 0, "seq_len": 7, "global_batch_size": 8, "num_windows": 30}
    with pytest.raises(ConfigError, match="former in-memory loader.*allow_data_change to continue from sample 24"):
        loader(synthetic(30), gbs=8).load_state_dict(old)
    allowed = loader(synthetic(30), gbs=8, allow=True)
    allowed.load_state_dict(old)
    assert allowed.samples_consumed == 24


def test_batch_size_must_divide():
    with pytest.raises(ConfigError, match=r"training.global_batch_size \(6\).*training.local_batch_size \(2\)"
                       r".*parallelism.data_parallel_shard_degree \(2\) = 4.*e.g. 4"):
        loader(synthetic(30), dp=2, lbs=2, gbs=6)


# ---- mixtures -------------------------------------------------------------------------------


def test_mixture_shares_within_one_percent_and_bitwise_resume():
    """0.8 / 0.2 over 100 steps of 8 samples: the delivered windows' sources are counted."""
    web, code = synthetic(5000, name="web"), synthetic(700, name="code", offset=100_000)
    mix = [web, code]
    run = loader(mix, weights=[0.8, 0.2], gbs=8, lbs=4)
    delivered = [w for _ in range(100) for w in window_ids(run.next_step())]
    share = sum(w >= 100_000 for w in delivered) / len(delivered)
    assert abs(share - 0.2) < 0.01, share
    assert run.shares() == pytest.approx({"data/share/web": 1 - share, "data/share/code": share})
    assert len(set(delivered)) == len(delivered)  # neither source has finished an epoch

    straight = loader(mix, weights=[0.8, 0.2], gbs=8, lbs=4)
    first = [straight.next_step() for _ in range(40)]
    sd = straight.state_dict()
    resumed = [loader(mix, weights=[0.8, 0.2], dp_rank=r, dp=2, gbs=8, lbs=2) for r in range(2)]
    for ld in resumed:
        ld.load_state_dict(sd)
    for _ in range(60):
        assert global_batch(resumed) == window_ids(straight.next_step())
    assert first and resumed[0].shares() == straight.shares()
    with pytest.raises(ConfigError, match="weight"):
        loader(mix, weights=[0.7, 0.3], gbs=8).load_state_dict(sd)


def test_mixture_schedule_keeps_every_prefix_on_target():
    schedule = MixtureSchedule([0.5, 0.3, 0.2])
    for n in range(1, 5000, 7):
        assert np.abs(schedule.counts(n) - np.array([0.5, 0.3, 0.2]) * n).max() <= 2
    source, index = schedule.locate(np.arange(1000))
    for i in range(3):  # each source's own indices come in order, without gaps
        assert index[source == i].tolist() == list(range((source == i).sum()))


def test_parse_mixture():
    assert parse_mixture(["data/web:0.8", "hub/name:2"]) == [("data/web", 0.8), ("hub/name", 2.0)]
    for bad in (["data/web"], ["data/web:zero"], ["x:-1"], ["x:nan"], [":1"]):
        with pytest.raises(ConfigError, match="training.dataset_mixture item"):
            parse_mixture(bad)


# ---- streaming ------------------------------------------------------------------------------


def test_streaming_windows_pack_restart_and_resume_with_same_dp(tok):
    docs = datasets.Dataset.from_dict({"text": DOCS * 4}).to_iterable_dataset(num_shards=4)

    def make(dp_rank, dp):
        shard = split_dataset_by_node(docs, rank=dp_rank, world_size=dp)
        return TokenDataLoader([StreamWindows("docs", shard, tok, 8)], seq_len=8, global_batch_size=4,
                               local_batch_size=1, dp_rank=dp_rank, dp_degree=dp, seed=0)

    run = make(1, 2)
    steps = [run.next_step() for _ in range(8)]  # several passes over this rank's two shards
    for micro in steps:
        assert len(micro) == 2
        for inputs, labels in micro:
            assert inputs.shape == (1, 8) and torch.equal(inputs[:, 1:], labels[:, :-1])
    run.reset()  # a stream restarts from its first window: validation sees the same batches
    assert all(torch.equal(a, c) for (a, _), (c, _) in zip(steps[0], run.next_step()))
    resumed = make(1, 2)
    first = make(1, 2)
    first.next_step(), first.next_step(), first.next_step()
    resumed.load_state_dict(first.state_dict())
    for micro in steps[3:]:
        assert all(torch.equal(a, c) for (a, _), (c, _) in zip(micro, resumed.next_step()))
    with pytest.raises(ConfigError, match="parallelism.data_parallel_shard_degree"):
        make(0, 4).load_state_dict(first.state_dict())


def test_streamed_mixture_interleaves_per_rank_and_resumes(tok):
    def stream(word):
        docs = datasets.Dataset.from_dict({"text": [f"{word} {i} " * 5 for i in range(40)]}).to_iterable_dataset(2)
        return StreamWindows(word, split_dataset_by_node(docs, rank=1, world_size=2), tok, 8)

    def make():
        return TokenDataLoader([stream("alpha"), stream("beta")], [0.75, 0.25], seq_len=8, global_batch_size=8,
                               local_batch_size=2, dp_rank=1, dp_degree=2, seed=0)

    run = make()
    steps = [torch.cat([x for x, _ in run.next_step()]) for _ in range(12)]
    words = [tok.decode(row.tolist()) for step in steps for row in step]
    from_beta = [("beta" in w) and ("alpha" not in w) for w in words]
    assert sum(from_beta) == len(words) // 4  # 48 rows of this rank: exactly 12 from beta
    assert run.shares() == {"data/share/alpha": 0.75, "data/share/beta": 0.25}
    resumed = make()
    half = make()
    for _ in range(5):
        half.next_step()
    resumed.load_state_dict(half.state_dict())
    for step in steps[5:]:
        assert torch.equal(torch.cat([x for x, _ in resumed.next_step()]), step)


def test_streamed_local_source_holds_out_validation_documents(tok, tmp_path):
    docs = [f"doc {i}: " + " ".join(f"w{i}_{j}" for j in range(20)) for i in range(400)]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    t = cfg(dataset_path=str(path), dataset_streaming=True)
    train = build_dataloader(t, tok, **kw(tmp_path))
    val = build_dataloader(t, tok, **kw(tmp_path), split="validation")

    def texts(ld, steps):
        rows = torch.cat([torch.cat([x, y[:, -1:]], 1) for _ in range(steps) for x, y in ld.next_step()])
        return {d for d in tok.decode(rows.flatten().tolist()).split("<|endoftext|>")}

    val_docs = set(docs) & texts(val, 20)
    train_docs = set(docs) & texts(train, 60)
    assert val_docs and len(train_docs) > 20 and not val_docs & train_docs
    val.reset()
    again = build_dataloader(t, tok, **kw(tmp_path), split="validation")
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(val.next_step(), again.next_step()))


# ---- build_dataloader: splits, errors, stdlib, pre-tokenized ---------------------------------


def cfg(**kw) -> Training:
    return Training(**{"seq_len": 16, "local_batch_size": 2, "global_batch_size": -1, "seed": 0,
                       "dataset_num_proc": 1, **kw})


def kw(tmp_path, dp=1, gbs=None):
    return dict(global_batch_size=gbs or 2 * dp, dp_rank=0, dp_degree=dp, device="cpu",
                dump_folder=str(tmp_path / "out"))


def test_validation_split_is_held_out_of_training(tok, tmp_path):
    docs = [f"document {i}: " + " ".join(f"w{i}_{j}" for j in range(30)) for i in range(40)]
    data = write_txt(tmp_path / "c", docs)
    t = cfg(dataset_path=data)
    train = build_dataloader(t, tok, **kw(tmp_path))
    val = build_dataloader(t, tok, **kw(tmp_path), split="validation")
    total = len(expected_stream(tok, docs)) // 17
    (train_src,), (val_src,) = train.sources, val.sources
    assert total > 40 and len(val_src) == validation_windows(total) == 4
    assert len(train_src) + len(val_src) == total and train_src.stop == val_src.start
    first_val = val.next_step()
    val.reset()
    assert torch.equal(val.next_step()[0][0], first_val[0][0])

    other = write_txt(tmp_path / "v", docs[:3])
    val_path = build_dataloader(t, tok, **kw(tmp_path), split="validation", dataset_path=other)
    assert len(val_path.sources[0]) == len(expected_stream(tok, docs[:3])) // 17


def test_build_dataloader_errors(tok, tmp_path):
    data = write_txt(tmp_path / "c", DOCS)
    with pytest.raises(ConfigError, match="training.global_batch_size"):
        build_dataloader(cfg(dataset_path=data), tok, **kw(tmp_path, dp=2, gbs=6))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ConfigError, match="training.dataset_path .* matches no"):
        build_dataloader(cfg(dataset_path=str(tmp_path / "empty")), tok, **kw(tmp_path))
    with pytest.raises(ConfigError, match="training.dataset_path .* fewer than one window.*training.seq_len"):
        build_dataloader(cfg(dataset_path=write_txt(tmp_path / "tiny", ["hi"])), tok, **kw(tmp_path))
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.txt").write_text("x")
    (tmp_path / "mixed" / "b.jsonl").write_text('{"text": "y"}\n')
    with pytest.raises(ConfigError, match="mixes formats"):
        build_dataloader(cfg(dataset_path=str(tmp_path / "mixed")), tok, **kw(tmp_path))
    small = write_txt(tmp_path / "small", DOCS[:2])
    assert 1 <= len(expected_stream(tok, DOCS[:2])) // 17 < 10
    build_dataloader(cfg(dataset_path=small), tok, **kw(tmp_path))  # trains on everything, holds out nothing
    with pytest.raises(ConfigError, match="too few to hold out a validation split.*validation.dataset_path"):
        build_dataloader(cfg(dataset_path=small), tok, **kw(tmp_path), split="validation")


def write_bin(path, tokens, dtype, **sidecar):
    with TokenFileWriter(str(path), np.dtype(dtype), **sidecar) as w:
        for start in range(0, len(tokens), 1000):
            w.write(tokens[start : start + 1000])


def test_pretokenized_bin_and_npy_read_as_one_stream(tok, tmp_path):
    tokens = np.random.default_rng(0).integers(0, tok.n_words, 5000)
    folder = tmp_path / "tokens"
    folder.mkdir()
    write_bin(folder / "a.bin", tokens[:1234], "uint32")
    np.save(folder / "b.npy", tokens[1234:3000].astype(np.int32))
    write_bin(folder / "c.bin", tokens[3000:], "int64")
    store = open_store(str(folder), tok, str(tmp_path / "cache"), key="training.dataset_path", num_proc=1)
    np.testing.assert_array_equal(store.read(0, len(store)), tokens)
    np.testing.assert_array_equal(store.rows(np.array([1230, 2990]), 17),
                                  np.stack([tokens[1230:1247], tokens[2990:3007]]))  # across file ends
    ld = build_dataloader(cfg(dataset_path=str(folder)), tok, **kw(tmp_path))
    inputs, labels = ld.next_step()[0]
    assert inputs.shape == (2, 16) and torch.equal(inputs[:, 1:], labels[:, :-1])


def test_pretokenized_input_errors_name_the_file_and_the_id(tok, tmp_path):
    def build(name):
        return build_dataloader(cfg(dataset_path=str(tmp_path / name)), tok, **kw(tmp_path))

    tokens = np.arange(3000) % 1000
    (tmp_path / "oov").mkdir()
    bad = tokens.copy()
    bad[2222] = tok.n_words
    np.save(tmp_path / "oov" / "x.npy", bad)
    with pytest.raises(ConfigError, match=rf"'.*oov/x.npy' holds id {tok.n_words} \(token 2222\), past the "
                                          rf"tokenizer's vocabulary of {tok.n_words} ids"):
        build("oov")
    (tmp_path / "nosidecar").mkdir()
    tokens[:2999].astype(np.uint16).tofile(tmp_path / "nosidecar" / "x.bin")
    with pytest.raises(ConfigError, match=r"x.bin' has no sidecar '.*x.bin.json' giving its dtype"):
        build("nosidecar")
    (tmp_path / "nosidecar" / "x.bin.json").write_text('{"dtype": "float32"}')
    with pytest.raises(ConfigError, match="sidecar dtype 'float32' is not one of"):
        build("nosidecar")
    (tmp_path / "nosidecar" / "x.bin.json").write_text('{"dtype": "uint32"}')
    with pytest.raises(ConfigError, match="not a whole number of uint32 tokens"):
        build("nosidecar")
    (tmp_path / "other").mkdir()
    write_bin(tmp_path / "other" / "x.bin", tokens, "uint16", tokenizer="someone-else")
    with pytest.raises(ConfigError, match="written by another tokenizer"):
        build("other")
    (tmp_path / "f").mkdir()
    np.save(tmp_path / "f" / "x.npy", tokens.astype(np.float32))
    with pytest.raises(ConfigError, match="float32 array.*1-D integer token arrays"):
        build("f")


def test_stdlib_corpus_builds_and_is_cached(tok, tmp_path, monkeypatch, caplog):
    files = stdlib_files(max_files=300)
    assert len(files) == 300 and files == sorted(files) and all(f.endswith(".py") for f in files)
    assert not any("site-packages" in f for f in stdlib_files())
    monkeypatch.setattr(trainer.data.documents, "stdlib_files", lambda: files)
    cache = tmp_path / "cache"
    start = time.perf_counter()
    with caplog.at_level("INFO", logger="trainer.data.ingest"):
        tokens = tokens_of("stdlib", tok, cache, num_proc=2)
    first = time.perf_counter() - start
    n_docs = sum(os.path.getsize(f) > 0 for f in files)
    assert re.search(rf"tokenized stdlib: 100%, {n_docs} documents, {len(tokens):,} tokens in .* tokens/s", caplog.text)
    start = time.perf_counter()
    again = tokens_of("stdlib", tok, cache)
    second = time.perf_counter() - start
    np.testing.assert_array_equal(tokens, again)
    assert len(tokens) > 100_000
    assert (tokens == tok.eos_id).sum() == n_docs
    with open(files[0], encoding="utf-8") as f:
        head = f.read(200)
    assert tok.decode(tokens[:200]).startswith(head)
    assert second < first / 3, (first, second)
    (store,) = [f for f in os.listdir(cache) if f.startswith("tokens-") and not f.endswith(("lock", "partial"))]
    assert sorted(os.listdir(cache / store))[:3] == ["STORE_KEY", "part-000000.bin", "part-000000.bin.json"]


def test_default_dataset_is_stdlib(tok, tmp_path, monkeypatch):
    # The whole corpus takes ~13 s to tokenize on 2 cores (docs/data.md); a prefix keeps this fast.
    monkeypatch.setattr(trainer.data.documents, "stdlib_files", lambda: stdlib_files(200))
    t = cfg(seq_len=512, local_batch_size=4)
    ld = build_dataloader(t, tok, **kw(tmp_path, gbs=4))
    n = len(ld.sources[0].store) // 513
    assert t.dataset == "stdlib" and n > 200 and len(ld.sources[0]) == n - validation_windows(n)
    inputs, labels = ld.next_step()[0]
    assert inputs.shape == (4, 512) and torch.equal(inputs[:, 1:], labels[:, :-1])


def test_interrupted_tokenization_resumes_where_it_stopped(tok, tmp_path, monkeypatch):
    docs = [f"doc {i} " + " ".join(str(i * j) for j in range(200)) for i in range(300)]
    data = tmp_path / "c.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    monkeypatch.setattr(trainer.data.documents, "PIECE_BYTES_MIN", 16 << 10)
    real = trainer.data.ingest._tokenize_unit
    calls = []

    def dies_on_the_fifth(args):
        calls.append(args[0])
        if len(calls) == 5:
            raise KeyboardInterrupt  # the job was killed
        return real(args)

    monkeypatch.setattr(trainer.data.ingest, "_tokenize_unit", dies_on_the_fifth)
    with pytest.raises(KeyboardInterrupt):
        tokens_of(str(data), tok, tmp_path / "cache")
    assert not [f for f in os.listdir(tmp_path / "cache") if f.endswith(".lock")]
    units = len(trainer.data.documents.group_pieces(plan_pieces([str(data)])))
    assert units > 6
    calls.clear()
    monkeypatch.setattr(trainer.data.ingest, "_tokenize_unit", lambda args: calls.append(args[0]) or real(args))
    tokens = tokens_of(str(data), tok, tmp_path / "cache")
    assert calls == list(range(4, units))  # the four finished units were kept
    np.testing.assert_array_equal(tokens, expected_stream(tok, docs))


def _build_in_rank(rank: int, data: str, dump: str, results) -> None:
    tok = build_tokenizer("")
    builds = []
    real = trainer.data.ingest.write_store
    trainer.data.ingest.write_store = lambda *a, **k: builds.append(rank) or real(*a, **k)
    t = cfg(dataset_path=data, local_batch_size=1)
    ld = build_dataloader(t, tok, global_batch_size=4, dp_rank=rank, dp_degree=2, device="cpu", dump_folder=dump)
    results[rank] = (builds, [torch.cat([x for x, _ in ld.next_step()]) for _ in range(3)])


def test_two_ranks_one_tokenizes_the_other_waits_and_batches_match_dp1(tok, tmp_path):
    docs = [f"doc {i} " + " ".join(str(i * j) for j in range(25)) for i in range(30)]
    data = write_txt(tmp_path / "c", docs)
    results = mp.Manager().dict()
    mp.spawn(_build_in_rank, args=(data, str(tmp_path / "out"), results), nprocs=2)  # no process group
    assert sorted(results[0][0] + results[1][0]) in ([0], [1])
    ref = build_dataloader(cfg(dataset_path=data, local_batch_size=4), tok, **kw(tmp_path, gbs=4))
    for step in range(3):
        assert torch.equal(torch.cat([results[0][1][step], results[1][1][step]]), ref.next_step()[0][0])


# ---- the build lock ---------------------------------------------------------------------------


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path, caplog):
    import socket
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    target = str(tmp_path / "thing")
    (tmp_path / "thing.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "since": 0}))
    with caplog.at_level("WARNING"):
        build_once(target, lambda: os.mkdir(target), what="building a thing")
    assert os.path.isdir(target) and not os.path.exists(target + ".lock")
    assert f"pid {dead.pid} on this host) is gone" in caplog.text


def test_a_data_error_reaches_the_processes_that_waited(tmp_path):
    """The builder's one-line error is raised by waiters too, instead of each rebuilding."""
    target = str(tmp_path / "thing")
    lock = tmp_path / "thing.lock"
    lock.write_text(json.dumps({"host": "elsewhere", "pid": 1, "since": 0}))  # held, alive
    outcome = []

    def wait():
        try:
            build_once(target, lambda: outcome.append("built"), what="building a thing")
        except ConfigError as e:
            outcome.append(str(e))

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(1.5)
    (tmp_path / "thing.error").write_text("data file 'x.jsonl', line 3: is not valid JSON. Fix it.")
    lock.unlink()  # the builder failed: error first, then the lock goes
    waiter.join(timeout=30)
    assert outcome == ["data file 'x.jsonl', line 3: is not valid JSON. Fix it."]
