"""HSDP (dp_replicate x dp_shard x tp) against one process, resume across the replicate dim, and
gradient accumulation that reduces once per step.

Tiny model, fp32, 5 steps, sequence parallel on where tp > 1; tolerance 1e-5 relative on every
step's loss and gradient norm, as for the 2-D meshes (tests/test_parallel_parity.py). Three
launches in all, since starting a process group of 4 or 8 costs 20-45 s on 2 cores: the
1-process references (the `references` fixture of tests/conftest.py, shared with
tests/test_parallel_parity.py), one 4-process launch, and one 8-process launch for 2x2x2.
The 4-process launch trains 2x2x1 (which writes the checkpoint of step 2) and both
accumulation modes, then resumes that checkpoint on 1x4x1 and 4x1x1.
"""

from tests.test_parallel_parity import BASE, TOLERANCE, launch

REPLICATE = ["--parallelism.data_parallel_replicate_degree"]
ACCUM = ["--training.global_batch_size", "16", "--training.local_batch_size", "1"]


def assert_close(reference, other, label, steps=range(1, 6)):
    got = {r["step"]: r for r in other}
    ref = {r["step"]: r for r in reference}
    assert sorted(got) == list(steps), label
    for step in steps:
        for key in ("loss", "grad_norm"):
            rel = abs(got[step][key] - ref[step][key]) / abs(ref[step][key])
            assert rel < TOLERANCE, f"{label} step {step} {key}: {got[step][key]} vs {ref[step][key]} (rel {rel:.2e})"


def test_hsdp_parity_resume_and_accumulation(tmp_path, corpus, references):
    base = BASE + ["--training.dataset_path", corpus]
    reference, reference16 = references[8], references[16]

    ckpt = tmp_path / "ckpt_2x2x1"
    hsdp = [*REPLICATE, "2", "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.folder", str(ckpt)]
    acc_step = [*REPLICATE, "2", *ACCUM, "--count-comms"]
    acc_micro = [*REPLICATE, "2", *ACCUM, "--parallelism.gradient_sync", "microbatch", "--count-comms"]
    one_micro = [*REPLICATE, "2", "--training.global_batch_size", "4", "--training.local_batch_size", "1",
                 "--training.steps", "1", "--count-comms"]
    # Resume the 2x2x1 checkpoint of step 2 on 1x4x1 and 4x1x1, after the run that writes it (their
    # last-step saves land in the same folder, which does not touch step-2).
    resumed = {name: [*REPLICATE, replicate, "--checkpoint.enable", "--checkpoint.folder", str(ckpt),
                      "--checkpoint.load_step", "2"]
               for name, replicate in (("1x4x1", "1"), ("4x1x1", "4"))}
    results = launch(tmp_path, 4, base, [hsdp, acc_step, acc_micro, one_micro, *resumed.values()])
    assert_close(reference, results[" ".join(hsdp)], "2x2x1")
    assert_close(reference16, results[" ".join(acc_step)], "2x2x1, 4 micro-batches, gradient_sync=step")
    assert_close(reference16, results[" ".join(acc_micro)], "2x2x1, 4 micro-batches, gradient_sync=microbatch")

    # Collectives per step: one micro-batch gives the gradient reduction of one step (a
    # reduce-scatter and a cross-replica all-reduce per FSDP unit). With 4 micro-batches,
    # "step" issues exactly that once; "microbatch" reduce-scatters 4 times, all-reduces once.
    (single,) = results[" ".join(one_micro) + "#comms"]
    units = single["c10d._reduce_scatter_base_"]
    assert units >= 3 and single["c10d.allreduce_"] == units
    for counts in results[" ".join(acc_step) + "#comms"]:
        assert (counts["c10d._reduce_scatter_base_"], counts["c10d.allreduce_"]) == (units, units), counts
    for counts in results[" ".join(acc_micro) + "#comms"]:
        assert (counts["c10d._reduce_scatter_base_"], counts["c10d.allreduce_"]) == (4 * units, units), counts

    for name, run in resumed.items():
        assert_close(reference, results[" ".join(run)], f"resumed on {name}", steps=range(3, 6))

    three_d = [*REPLICATE, "2", "--parallelism.tensor_parallel_degree", "2"]
    results = launch(tmp_path, 8, base, [three_d])
    assert_close(reference, results[" ".join(three_d)], "2x2x2")
