"""scripts/trace_summary.py on real kernel names and on a CPU trace of a training step,
scripts/benchmark.py's launch and parsing of the torchtitan anchor, and scripts/gpu_clocks.py's
sampling of the GPU's clock and power."""

import os
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from tests.dist_utils import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
from benchmark import _ANCHOR_LINE, PRESETS, comparison_table, free_form_variant, named_variant, run_anchor  # noqa: E402
from gpu_clocks import ClockSampler, busy_medians  # noqa: E402
from trace_summary import CATEGORIES, classify, format_breakdown, summarize  # noqa: E402

# Kernel names as torch 2.11 on an H200 spells them (issue 10's profile) or close to it.
KERNELS = {
    "nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNT": "matmul",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1": "matmul",
    "triton_tem_fused_mm_0": "matmul",
    "cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0": "attention",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, true>(Flash_fwd_params)":
        "attention",
    "triton_poi_fused__scaled_dot_product_cudnn_attention__to_copy__unsafe_view_clone_expand_3": "copies+casts",
    "triton_poi_fused__to_copy_1": "copies+casts",
    "triton_red_fused__fused_rms_norm__to_copy_mul_2": "norm+pointwise",
    "triton_poi_fused_add_mul_silu_5": "norm+pointwise",
    "void at::native::elementwise_kernel<128, 2, at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)>":
        "copies+casts",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 1, 128, 1>": "copies+casts",
    "Memcpy DtoD (Device -> Device)": "copies+casts",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3> >":
        "norm+pointwise",
    "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "collectives",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>":
        "optimizer",
    "void at::native::multi_tensor_apply_kernel<TensorListMetadata<1>, LpNormFunctor<float, 2, double>>":
        "optimizer",
    "aten::mm": "matmul",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "aten::_to_copy": "copies+casts",
    "aten::rms_norm": "norm+pointwise",
    "aten::_foreach_norm": "optimizer",
}


def test_classify_kernel_and_op_names():
    wrong = {name: (classify(name), want) for name, want in KERNELS.items() if classify(name) != want}
    assert not wrong, wrong


def test_cpu_trace_of_a_training_step(tmp_path):
    torch.manual_seed(0)
    w1, w2 = (torch.nn.Parameter(torch.randn(64, 64) * 0.1) for _ in range(2))
    opt = torch.optim.AdamW([w1, w2], foreach=True)
    x = torch.randn(256, 64)

    def step():
        h = F.rms_norm(x, (64,))
        q = (h @ w1).view(256, 4, 16).transpose(0, 1)
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(0, 1).reshape(256, 64)
        (out @ w2).float().square().mean().backward()
        opt.step()
        opt.zero_grad()

    path = str(tmp_path / "trace.json")
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=2, repeat=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule,
                                on_trace_ready=lambda p: p.export_chrome_trace(path)) as prof:
        for _ in range(3):
            step()
            prof.step()

    summary = summarize(path)
    assert summary["device"] == "cpu" and summary["steps"] == 2
    ms = summary["ms"]
    assert set(ms) == set(CATEGORIES)
    for category in ("matmul", "attention", "norm+pointwise", "optimizer"):
        assert ms[category] > 0, (category, ms)
    assert ms["collectives"] == 0
    # self times never exceed the step's wall time, and the step is mostly ops
    assert 0 < sum(ms.values()) <= summary["step_ms"] * 1.01
    table = format_breakdown({"weft": summary, "other": summary})
    assert "matmul" in table and "step wall" in table


def test_anchor_summary_line():
    line = ("torchtitan sac        lbs=2 tps 20,627  mfu 57.8%  max reserved 68.6 GiB  max active 67.6 GiB")
    m = _ANCHOR_LINE.search("noise\n" + line + "\n")
    assert (m["variant"], m["tps"], m["mfu"], m["reserved"], m["active"]) == ("sac", "20,627", "57.8", "68.6", "67.6")
    weft = {"variant": "sac", "ok": True, "tps": 22000.0, "mfu_pct": 61.7, "mem_active_gib": 60.0,
            "mem_reserved_gib": 66.0, "recompiles_after_warmup": 0, "wall_s": 80.0}
    anchor = {"ok": True, "tps": 20627.0, "mfu_pct": 57.8, "mem_active_gib": 67.6, "mem_reserved_gib": 68.6,
              "wall_s": 90.0}
    row = comparison_table([(weft, anchor)]).splitlines()[-1]
    assert "1.067x" in row and "-2.6" in row and "22,000" in row
    assert "- / -" in row  # no clock samples (no nvidia-smi) print as missing
    row = comparison_table([({**weft, "sm_mhz": 1560.0, "power_w": 691.8}, {**anchor, "sm_mhz": 1620.0,
                                                                            "power_w": 689.5})]).splitlines()[-1]
    assert "1560 / 692" in row and "1620 / 690" in row


def test_run_anchor_passes_shape_and_parses(tmp_path):
    """run.sh gets WHEEL_DIR OUT_DIR LOCAL_BATCH VARIANT and the flavor/profile switches."""
    anchor = tmp_path / "anchor"
    anchor.mkdir()
    (anchor / "run.sh").write_text(
        'echo "torchtitan $4        lbs=$3 tps 8,450  mfu 52.1%  max reserved 121.7 GiB"\n'
        'echo "args $# $3 $4 flavor=$ANCHOR_FLAVOR profile=$ANCHOR_PROFILE alloc=$PYTORCH_ALLOC_CONF" >&2\n'
    )
    result = run_anchor("full", str(anchor), str(tmp_path / "wheels"), PRESETS["8b"], str(tmp_path / "out"), True)
    assert result["ok"] and result["tps"] == 8450.0 and result["mem_reserved_gib"] == 121.7
    assert result["mem_active_gib"] is None
    assert result["output"].startswith("args 4 1 full flavor=8B profile=true alloc=")
    failed = run_anchor("noac", str(tmp_path), "w", PRESETS["3b"], str(tmp_path / "out"), False)
    assert not failed["ok"]


def test_layout_variants_lay_out_every_block_of_the_preset_model():
    """opallNN / opNN variants write a per_block layout the config accepts for the preset's model."""
    from models.llama3.args import FLAVORS
    from parallel.activation_checkpoint import parse_per_block

    for preset in PRESETS.values():
        n_blocks = FLAVORS[preset.anchor_flavor].n_layers
        for name, kinds, anchor in (("opall17", ("op_all", "op"), "sac"), ("op19", ("op", "full"), "full")):
            variant = named_variant(name, preset)
            layout = variant.overrides[variant.overrides.index("--activation_checkpoint.per_block") + 1]
            count = int(name.lstrip("opal"))
            assert parse_per_block(layout, n_blocks) == [kinds[0]] * count + [kinds[1]] * (n_blocks - count)
            assert variant.anchor == anchor
        every = named_variant(f"opall{n_blocks}", preset)
        assert every.overrides[-1] == f"op_all:{n_blocks}"


def test_free_form_variant_values_may_hold_commas():
    variant = free_form_variant("lay@sac:--compile.enable,true,--activation_checkpoint.per_block,op_all:16,op:12,"
                                "--training.local_batch_size,-1,--metrics.no-enable_tensorboard")
    assert (variant.name, variant.anchor) == ("lay", "sac")
    assert variant.overrides == ["--compile.enable", "true", "--activation_checkpoint.per_block", "op_all:16,op:12",
                                 "--training.local_batch_size", "-1", "--metrics.no-enable_tensorboard"]
    assert free_form_variant("plain:").overrides == []


# Lines of nvidia-smi --query-gpu=clocks.sm,power.draw,utilization.gpu --format=csv,noheader,nounits,
# with samples an H200 gave over a run (idle at start-up and compilation, busy in the steps), a
# board that reports no values and a line cut off when the sampler stopped.
SMI_LINES = ["345, 78.32, 0", "1980, 119.55, 0", "1980, 129.31, 100", "1530, 691.64, 100",
             "1590, 688.54, 100", "1470, 693.54, 97", "1980, 250.83, 21", "[N/A], [N/A], 100", "1560, 69"]


def test_busy_medians_count_only_the_busy_samples():
    assert busy_medians(SMI_LINES) == {"sm_mhz": 1560.0, "power_w": pytest.approx(690.09)}
    assert busy_medians(SMI_LINES, min_utilization=98) == {"sm_mhz": 1590.0, "power_w": 688.54}
    assert busy_medians(["345, 78.3, 0"]) == {}


def test_clock_sampler_runs_nvidia_smi_while_the_block_runs(tmp_path, monkeypatch):
    """A stand-in nvidia-smi on PATH: the sampler passes the query and interval, reads what it
    printed until the block ended, and stops it; without nvidia-smi the result is empty."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\n"
                    'echo "$@" > "$(dirname "$0")/args"\n'
                    + "".join(f"echo '{line}'\n" for line in SMI_LINES)
                    + "exec sleep 60\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with ClockSampler(interval_ms=100) as sampler:
        deadline = time.monotonic() + 10
        while not (tmp_path / "args").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
    assert sampler.result == busy_medians(SMI_LINES)
    assert (tmp_path / "args").read_text().split() == [
        "--query-gpu=clocks.sm,power.draw,utilization.gpu", "--format=csv,noheader,nounits", "-lms", "100"]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with ClockSampler() as sampler:
        pass
    assert sampler.result == {}
