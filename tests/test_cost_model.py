"""pk_jax.cost_model: the plan of the fused tensor-parallel GEMM ops (CPU only, no device)."""

import dataclasses
import pathlib
import sys

import pytest
from util import product

from pk_jax import cost_model as cm


@pytest.mark.parametrize("op", cm.OPS)
def test_p1_runs_local(op):
    pl = cm.plan(op, 4096, 4096, 4096, 1)
    assert pl.mode == "local" and pl.num_comm_sms == 0


@pytest.mark.parametrize("op,n,p", product(cm.OPS, (4096, 16384), (2, 8)))
def test_plan_is_the_fastest_prediction_beyond_the_margin(op, n, p):
    # "auto": the fastest prediction of each mode; fused only where it beats serial's by more
    # than the model's margin of its own time.
    k = n if op == "ag_gemm" else n // p
    pl = cm.plan(op, n, n, k, p)
    best = {mode: min(cm.predict(op, n, n, k, p, mode=mode, num_comm_sms=c).predicted_us
                      for c in (cm.COMM_SMS_CANDIDATES if op == "ag_gemm" and mode == "fused"
                                else (0,)))
            for mode in ("fused", "serial")}
    want = "fused" if best["fused"] * (1 + cm.margin(op)) < best["serial"] else "serial"
    assert pl.mode == want and pl.predicted_us == pytest.approx(best[want])
    if pl.mode == "fused" and op == "ag_gemm":
        assert pl.num_comm_sms in cm.COMM_SMS_CANDIDATES


def test_a_near_tie_goes_to_serial():
    # gemm_rs 8192 x 8192 x k at P = 4 on the H200, k where fused is predicted faster by less
    # than its margin: "auto" runs serial, a forced fused still runs fused.
    def gap(k):
        f = cm.predict("gemm_rs", 8192, 8192, k, 4, mode="fused").predicted_us
        return cm.predict("gemm_rs", 8192, 8192, k, 4, mode="serial").predicted_us / f - 1
    k = next(k for k in range(256, 16384, 64) if 0 < gap(k) < cm.margin("gemm_rs"))
    fused = cm.predict("gemm_rs", 8192, 8192, k, 4, mode="fused").predicted_us
    serial = cm.predict("gemm_rs", 8192, 8192, k, 4, mode="serial").predicted_us
    assert fused < serial < fused * (1 + cm.margin("gemm_rs"))
    assert cm.plan("gemm_rs", 8192, 8192, k, 4).mode == "serial"
    with cm.override(mode="fused"):
        assert cm.plan("gemm_rs", 8192, 8192, k, 4).mode == "fused"
    f, s = (cm.Plan(md, 0, us, {}) for md, us in (("fused", 100.0), ("serial", 100.0)))
    assert cm.auto_pick("gemm_rs", f, s) is s
    beyond = dataclasses.replace(s, predicted_us=100.0 * (1 + cm.margin("gemm_rs")) + 1e-6)
    assert cm.auto_pick("gemm_rs", f, beyond) is f
    # the margin is the error of the model that predicts fused: ag_gemm's kernel model its
    # measured P = 1 error, the overlap form (gemm_rs, gemm_ar, ring, Ulysses, MoE) its own
    assert cm.margin("ag_gemm") == cm.FUSED_MARGIN["ag_gemm"]
    assert all(cm.margin(op) == cm.OVERLAP_MARGIN for op in cm.TP_OVERLAP_FORM + cm.OVERLAP_OPS)
    wider = dataclasses.replace(s, predicted_us=100.0 * (1 + cm.margin("gemm_rs")) + 1e-6)
    assert cm.margin("ag_gemm") > cm.margin("gemm_rs")
    assert cm.auto_pick("gemm_rs", f, wider) is f and cm.auto_pick("ag_gemm", f, wider) is wider


def test_fused_margin_is_the_measured_p1_error():
    # FUSED_MARGIN is derived per op from the H200's P = 1 forced-fused rows, not from the
    # emulated fused-vs-serial cases it is judged on: bench/check_cost_model.py recomputes it.
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    import check_cost_model

    errs = check_cost_model.fused_p1_errors()
    assert len(errs) >= 30 and {op for op, *_ in errs} == set(cm.OPS)
    assert set(cm.FUSED_MARGIN) == set(cm.OPS) - set(cm.TP_OVERLAP_FORM)
    for op in cm.FUSED_MARGIN:
        assert cm.FUSED_MARGIN[op] == pytest.approx(check_cost_model.fused_margin(op), abs=5e-4)


def test_emulated_cases_use_the_rows_rates():
    # check_cost_model judges the model with each emulated row's own constants: the throttle's
    # cap, or unthrottled the lower of the partition's copy rate and its share of the HBM (rows
    # before partition_copy_gbps stored that rate / P), and the measured partition GEMM rate.
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    import check_cost_model
    from bench_emulated import partition_gpu, unthrottled_link_gbps

    hbm_share = cm.H200.copy_gbps / 2 / 8
    old = {"world": 8, "link": "unthrottled", "link_gbps": 71.8}
    assert check_cost_model.link_gbps(old) == pytest.approx(min(71.8 * 8, hbm_share))
    new = dict(old, partition_copy_gbps=100.0)
    assert check_cost_model.link_gbps(new) == pytest.approx(100.0)
    capped = {"world": 8, "link": "throttled 1750 FLOP/B", "throttled": True, "link_gbps": 56.8}
    assert check_cost_model.link_gbps(capped) == 56.8
    assert unthrottled_link_gbps(2, 1356.0) == pytest.approx(cm.H200.copy_gbps / 2 / 2)
    gpu = partition_gpu(4, 32, 100.0, tflops=206.1)
    assert gpu.peak_tflops * gpu.gemm_efficiency == pytest.approx(206.1)
    assert partition_gpu(4, 32, 100.0).gemm_efficiency == cm.H200.gemm_efficiency
    # the comm-SM sweep's rows are data, not cases: the latest row per case is the model's
    for op in cm.OPS:
        assert all(not r.get("comm_sms_forced")
                   for r in check_cost_model.latest_rows(op).values())


def test_ag_gemm_fp8_gathers_fp8_bytes_at_the_fp8_rate():
    """all_gather_gemm's fp8 form: the GEMM at FP8_SPEEDUP[scaling], the gathered rows in one
    byte, in both modes; at P = 1 the fp8 GEMM alone."""
    m, n, k, p = 8192, 8192, 4096, 4
    for mode in ("serial", "fused"):
        bf16 = cm.predict("ag_gemm", m, n, k, p, mode=mode, num_comm_sms=8)
        for scaling, speedup in cm.FP8_SPEEDUP.items():
            f8 = cm.predict("ag_gemm", m, n, k, p, mode=mode, num_comm_sms=8, fp8=scaling)
            if mode == "serial":
                assert f8.terms["comp"] == pytest.approx(bf16.terms["comp"] / speedup)
                assert f8.terms["non_overlap"] < bf16.terms["non_overlap"]
            else:
                assert f8.terms["comm"] == pytest.approx(bf16.terms["comm"] / 2)
    assert cm.plan("ag_gemm", m, n, k, 1, fp8="tensor").mode == "local"
    # at P > 1 the fused kernel (FP8_GATHER_FUSED), also where the model predicts serial faster
    for scaling in cm.FP8_SPEEDUP:
        fused = cm.predict("ag_gemm", m, n, k, p, mode="fused", num_comm_sms=8, fp8=scaling)
        serial = cm.predict("ag_gemm", m, n, k, p, mode="serial", fp8=scaling)
        assert fused.predicted_us > serial.predicted_us
        pl = cm.plan("ag_gemm", m, n, k, p, fp8=scaling)
        assert pl.mode == "fused" and pl.num_comm_sms > 0
        assert cm.plan("ag_gemm", m, n, k, p).mode == "serial"  # bf16: the model's pick
        with cm.override(mode="serial"):
            assert cm.plan("ag_gemm", m, n, k, p, fp8=scaling).mode == "serial"


def test_terms_add_up():
    pl = cm.predict("gemm_rs", 8192, 8192, 1024, 8, mode="fused")
    t = pl.terms
    want = (t["launch"] + max(t["comp"], t["mem"], t["comm"]) + t["non_overlap"] + t["sync"])
    assert pl.predicted_us == pytest.approx(want)


@pytest.mark.parametrize("op", ("gemm_rs", "gemm_ar"))
def test_fp8_forms_use_the_fp8_rate_and_bytes(op):
    """The fp8 forms: the GEMM's compute term divided by FP8_SPEEDUP[scaling], its operands'
    bytes halved, the output (and so the collective) still bf16."""
    m, n, k, p = 8192, 8192, 2048, 4
    bf16 = cm.predict(op, m, n, k, p, mode="serial")
    for scaling, speedup in cm.FP8_SPEEDUP.items():
        f8 = cm.predict(op, m, n, k, p, mode="serial", fp8=scaling)
        assert f8.terms["comp"] == pytest.approx(bf16.terms["comp"] / speedup)
        assert f8.terms["non_overlap"] == pytest.approx(bf16.terms["non_overlap"])
        assert f8.terms["mem"] == pytest.approx(bf16.terms["mem"] * (m * k + k * n + 2 * m * n)
                                                / (2 * (m * k + k * n + m * n)))
        assert cm.plan(op, m, n, k, 1, fp8=scaling).mode == "local"
    with pytest.raises(ValueError, match="fp8='e4m3'"):
        cm.predict(op, m, n, k, p, mode="serial", fp8="e4m3")
    # the one decider names the fp8 forms by their ops (the validation cases' and rows' name)
    for scaling in cm.FP8_SPEEDUP:
        for p in (2, 8):
            shape = {"m": m, "n": n, "k_per_rank": k, "scaling": scaling}
            want = cm.plan(op, m, n, k, p, gpu=cm.H100, fp8=scaling).mode
            assert cm.choose(f"{op}_fp8", shape, p, gpu=cm.H100) == want


def test_large_k_prefers_fused_gemm_rs():
    # K well above the overlap bound: the GEMM hides the pushes.
    assert cm.plan("gemm_rs", 16384, 16384, 16384 // 8, 8).mode == "fused"


def test_override_context_and_nesting():
    with cm.override(mode="serial"):
        assert cm.plan("gemm_rs", 16384, 16384, 2048, 8).mode == "serial"
        with cm.override(num_comm_sms=20):
            pl = cm.plan("ag_gemm", 16384, 16384, 16384, 8)
            assert pl.mode == "serial"
        with cm.override(mode="fused", num_comm_sms=20):
            pl = cm.plan("ag_gemm", 16384, 16384, 16384, 8)
            assert (pl.mode, pl.num_comm_sms) == ("fused", 20)
    with cm.override(mode="fused"):
        assert cm.plan("gemm_ar", 256, 256, 64, 1).mode == "fused"
    assert cm.plan("gemm_ar", 256, 256, 64, 1).mode == "local"


def test_override_env(monkeypatch):
    monkeypatch.setenv("PK_JAX_TP_MODE", "serial")
    assert cm.plan("gemm_rs", 16384, 16384, 2048, 8).mode == "serial"
    monkeypatch.setenv("PK_JAX_TP_MODE", "fused")
    monkeypatch.setenv("PK_JAX_TP_COMM_SMS", "6")
    pl = cm.plan("ag_gemm", 4096, 4096, 4096, 8)
    assert (pl.mode, pl.num_comm_sms) == ("fused", 6)


@pytest.mark.parametrize("kw,match", [({"mode": "fast"}, "mode='fast' is not one of"),
                                      ({"num_comm_sms": 0}, "must be an int in 1..128"),
                                      ({"num_comm_sms": 200}, "must be an int in 1..128")])
def test_override_errors(kw, match):
    with pytest.raises(ValueError, match=match), cm.override(**kw):
        pass


def test_gpu_constants():
    assert cm.gpu_for("NVIDIA H200") is cm.H200
    assert cm.gpu_for("NVIDIA H100 80GB HBM3") is cm.H100


@pytest.mark.parametrize("op", cm.OPS)
def test_p1_fused_costs_little_more_than_local(op):
    # Forced fused at P = 1: gemm_rs and gemm_ar store their tiles straight into y (epoch
    # kernel + GEMM at FUSED_EFFICIENCY of pk.matmul's rate); ag_gemm's comm SMs copy x into
    # x_full while the GEMM runs and every SM copies what is left after the last tile (no other
    # comm traffic, nothing waits for the copy).
    k = 4096
    local = cm.predict(op, 4096, 4096, k, 1, mode="local").predicted_us
    fused = cm.predict(op, 4096, 4096, k, 1, mode="fused", num_comm_sms=4)
    if op == "ag_gemm":
        t = fused.terms
        left = 4096 * k * 2 - 4 * cm.H200.pull_gbps_per_sm * 1e9 * t["comp"] * 1e-6
        assert left > 0
        assert t["comm"] == 0 and t["sync"] == 0
        assert t["non_overlap"] == pytest.approx(2 * left / (cm.H200.copy_gbps * 1e9) * 1e6)
        # the tail shrinks with more comm SMs, the GEMM's SMs with it: the plan balances them
        with cm.override(mode="fused"):
            pl = cm.plan(op, 4096, 4096, k, 1)
        tails = [cm.predict(op, 4096, 4096, k, 1, mode="fused", num_comm_sms=c).terms[
            "non_overlap"] for c in cm.COMM_SMS_CANDIDATES]
        assert tails == sorted(tails, reverse=True) and tails[0] > pl.terms["non_overlap"]
        assert pl.terms["non_overlap"] < 0.05 * pl.terms["comp"]
        assert pl.predicted_us < 1.15 * local
    else:
        assert fused.terms["non_overlap"] == 0 and fused.terms["sync"] == 0
        # the GEMM at the fused kernel's measured rate, plus the epoch kernel
        comp = local - cm.H200.launch_us
        assert fused.predicted_us == pytest.approx(
            2 * cm.H200.launch_us + comp / cm.FUSED_EFFICIENCY[op])


def test_ag_gemm_fused_counts_part_of_its_gather():
    # Measured in the rank emulator, fused ag_gemm hides about half of its gather behind the
    # GEMM (cost_model.GATHER_EXPOSED): on a slow link its time is the gather plus half of it
    # again, so "auto" picks serial where the gather dominates.
    slow = dataclasses.replace(cm.H200, nvlink_gbps=10.0)
    p, m, n, k = 4, 8192, 2048, 4096
    fused = cm.predict("ag_gemm", m, n, k, p, mode="fused", num_comm_sms=8, gpu=slow)
    gather_us = (p - 1) * (m // p) * k * 2 / (slow.nvlink_gbps * 1e9) * 1e6
    assert fused.terms["comm"] == pytest.approx(gather_us)
    assert fused.terms["non_overlap"] >= cm.GATHER_EXPOSED * gather_us
    assert fused.predicted_us > (1 + cm.GATHER_EXPOSED) * gather_us
    assert cm.plan("ag_gemm", m, n, k, p, gpu=slow).mode == "serial"


@pytest.mark.parametrize("op,p", product(cm.OPS, (2, 4, 8)))
def test_serial_collective_stages_then_pulls(op, p):
    # The serial path's collective runs as pk's engine does: a local staging copy (read x, write
    # the workspace) and then the pulls, each phase at the slower of its HBM traffic at the
    # measured copy rate and its peer bytes at the link rate.
    m, n, k, it = 8192, 8192, 4096, 2
    serial = cm.predict(op, m, n, k, p, mode="serial")
    out, shard = it * m * n, it * (m // p) * k
    phases = cm.collective_phases(op, out, shard, p)
    staged = out if op != "ag_gemm" else shard
    assert phases[0] == (2 * staged, 0.0)
    link = {"gemm_rs": (p - 1) / p * out, "ag_gemm": (p - 1) * shard,
            "gemm_ar": (p - 1) * out if p <= 2 else 2 * (p - 1) / p * out}[op]
    assert sum(x for _, x in phases) == pytest.approx(link)
    g = cm.H200
    want = sum(max(h / (g.copy_gbps * 1e3), x / (g.nvlink_gbps * 1e3)) for h, x in phases)
    assert serial.terms["non_overlap"] == pytest.approx(want)
    # On NVLink the pulls bind: the collective is its link time plus the staging copy.
    assert want == pytest.approx(link / (g.nvlink_gbps * 1e3) + 2 * staged / (g.copy_gbps * 1e3))


def test_serial_collective_hbm_bound_on_a_shared_hbm():
    # A rank emulator partition (P = 2: HBM and its copy rate halved, the link at the copy
    # rate / P): the reduce_scatter's HBM traffic, not its peer bytes, sets the time.
    p = 2
    part = dataclasses.replace(cm.H200, sms=64, hbm_gbps=cm.H200.hbm_gbps / p,
                               copy_gbps=cm.H200.copy_gbps / p, nvlink_gbps=745.0)
    out = 2 * 8192 * 8192
    us = cm.collective_us("gemm_rs", out, 0, p, part)
    assert us == pytest.approx((2 * out + out + out / p) / (part.copy_gbps * 1e3))
    assert us > (p - 1) / p * out / (part.nvlink_gbps * 1e3)


@pytest.mark.parametrize("op,p", product(cm.OPS, (2, 8)))
def test_a_short_collective_costs_the_floor(op, p):
    # Every call of pk's collective engine at P > 1 takes at least COLLECTIVE_FLOOR_US (the
    # short all_gathers of the scale-model rows); the bandwidth terms decide above it, and at
    # P = 1 (a local copy) there is no floor.
    g = cm.H200
    assert cm.collective_us(op, 4096, 4096, p, g) == cm.COLLECTIVE_FLOOR_US
    assert cm.collective_us(op, 4096, 4096, 1, g) < 1.0
    big = 1 << 28
    want = sum(max(h / (g.copy_gbps * 1e3), x / (g.nvlink_gbps * 1e3))
               for h, x in cm.collective_phases(op, big, big, p))
    assert want > cm.COLLECTIVE_FLOOR_US
    assert cm.collective_us(op, big, big, p, g) == pytest.approx(want)


def test_ulysses_all_to_alls_cost_the_floor_each():
    # The serial Ulysses backward is eight all_to_alls; at a small shape each costs the floor.
    g = cm.H200
    tiny = {"s": 256, "h": 8, "d": 64, "causal": False}
    _, tm = cm.overlap_parts("ulysses_attn_bwd", tiny, 4)
    assert tm == pytest.approx(8 * (cm.COLLECTIVE_FLOOR_US + g.launch_us + g.barrier_us))


@pytest.mark.parametrize("op,p", product(cm.TP_OVERLAP_FORM, (2, 4, 8)))
def test_gemm_rs_ar_fused_is_the_overlap_form(op, p):
    # At P > 1 the fused gemm_rs / gemm_ar time is the overlap form over the serial path's own
    # parts: pk.matmul's time tc and the collective's tm, max(tc, tm) + a tc + b tm, plus the
    # fused kernel's launches and barriers.
    m = n = 8192
    for k in (512, 8192):
        serial = cm.predict(op, m, n, k, p, mode="serial")
        tc, tm = max(serial.terms["comp"], serial.terms["mem"]), serial.terms["non_overlap"]
        assert serial.predicted_us == pytest.approx(tc + tm + serial.terms["launch"]
                                                    + serial.terms["sync"])
        fused = cm.predict(op, m, n, k, p, mode="fused")
        a, b = cm.FUSED_OVERHEAD[op]
        t = fused.terms
        assert (t["comp"], t["comm"]) == pytest.approx((tc, tm))
        assert fused.predicted_us == pytest.approx(t["launch"] + max(tc, tm) + a * tc + b * tm
                                                   + t["sync"])
    # the fused kernel slows its GEMM by a quarter or more and hides most of the collective:
    # fused where the collective is a large share (K = 2048), serial where the GEMM dominates
    assert cm.FUSED_OVERHEAD[op][0] > 0.25 and cm.FUSED_OVERHEAD[op][1] < 0.25
    assert cm.plan(op, m, n, 2048, p).mode == "fused"
    assert cm.plan(op, m, n, 8192, p).mode == "serial"


def test_decider_constants_are_the_fit():
    # COLLECTIVE_FLOOR_US, every FUSED_OVERHEAD and PIPELINE_OVERHEAD are what
    # bench/fit_decider.py fits on the committed scale-model rows of its TRAIN_TAGS.
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    import fit_decider

    rows = fit_decider.load()
    assert {r["tag"] for r in rows} == set(fit_decider.TRAIN_TAGS)
    floor, overhead, pipeline = fit_decider.fit(rows)
    assert cm.COLLECTIVE_FLOOR_US == floor
    assert set(overhead) == set(cm.FUSED_OVERHEAD) == set(cm.TP_OVERLAP_FORM + cm.OVERLAP_OPS)
    assert set(pipeline) == set(cm.PIPELINE_OVERHEAD) == set(cm.OVERLAP_OPS)
    for fitted, committed in ((overhead, cm.FUSED_OVERHEAD), (pipeline, cm.PIPELINE_OVERHEAD)):
        for op, coef in fitted.items():
            assert committed[op] == pytest.approx(coef, abs=5e-4)
            assert min(committed[op]) >= 0


def test_overlap_form_pipeline_share_falls_with_p():
    # fused = max(tc, tm) + (a + c 2/P) tc + (b + d 2/P) tm: the pipeline share (c, d) is the
    # whole of it at P = 2 and a quarter at P = 8; serial is tc + tm.
    shape = {"s": 16384, "h": 32, "d": 128, "causal": False}
    for p in (2, 4, 8):
        tc, tm = cm.overlap_parts("ulysses_attn_bwd", shape, p)
        a, b = cm.FUSED_OVERHEAD["ulysses_attn_bwd"]
        c, d = cm.PIPELINE_OVERHEAD["ulysses_attn_bwd"]
        fused, serial = cm.predict_overlap("ulysses_attn_bwd", shape, p)
        assert serial == pytest.approx(tc + tm)
        assert fused == pytest.approx(max(tc, tm) + (a + 2 * c / p) * tc + (b + 2 * d / p) * tm)
    # with no pipeline share the form is the flat one of the first two rounds
    saved = dict(cm.PIPELINE_OVERHEAD)
    try:
        cm.PIPELINE_OVERHEAD.clear()
        tc, tm = cm.overlap_parts("ulysses_attn_bwd", shape, 4)
        a, b = cm.FUSED_OVERHEAD["ulysses_attn_bwd"]
        assert cm.predict_overlap("ulysses_attn_bwd", shape, 4)[0] == pytest.approx(
            max(tc, tm) + a * tc + b * tm)
    finally:
        cm.PIPELINE_OVERHEAD.update(saved)


def test_choose_overlap_families():
    """The one decider for ring, Ulysses and MoE: serial where the fused kernel's fitted
    overheads exceed what it hides (the Ulysses forward always), fused where the exchange is a
    large share and the kernel hides it (the fused MoE GEMM + combine at DeepSeek-V3 size), and
    the TP GEMMs through `plan`."""
    moe = {"t": 2048, "k": 8, "experts": 256, "h": 7168, "hidden": 2048}
    assert cm.choose("moe_gemm_combine", moe, 8) == "fused"
    uly = {"s": 8192, "h": 64, "d": 128, "causal": False}
    assert cm.choose("ulysses_attn", uly, 8) == "serial"
    tc, tm = cm.overlap_parts("ulysses_attn", uly, 8)
    fused, serial = cm.predict_overlap("ulysses_attn", uly, 8)
    assert serial == pytest.approx(tc + tm) and fused >= max(tc, tm)
    tp = {"m": 8192, "n": 8192, "k_per_rank": 2048}
    assert cm.choose("gemm_rs", tp, 8) == cm.plan("gemm_rs", 8192, 8192, 2048, 8).mode
    with pytest.raises(ValueError, match="not one of"):
        cm.overlap_parts("matmul", uly, 8)


def test_overlap_overrides_blocks_then_settings(monkeypatch):
    """cm.overlap_override, which _backend.route asks before the decider: the innermost
    override_ops block naming the op, else PK_JAX_ULYSSES_FUSED / PK_JAX_MOE_FUSED as mapped
    per op (Ulysses "1": fused forward, composed backward; "bwd" the other way round), else
    None; settings outside their values and unknown ops are ValueErrors that name them."""
    from pk_jax.runtime import state

    def with_settings(**kw):
        monkeypatch.setattr(state, "settings", lambda: state.Settings(**kw))

    with_settings()
    assert all(cm.overlap_override(op) is None for op in cm.ROUTED_OVERLAP_OPS)
    want = {"1": ("fused", "serial"), "bwd": ("serial", "fused"), "0": ("serial", "serial")}
    for value, (fwd, bwd) in want.items():
        with_settings(ulysses_fused=value)
        assert cm.overlap_override("ulysses_attn") == fwd, value
        assert cm.overlap_override("ulysses_attn_bwd") == bwd, value
        assert cm.overlap_override("moe_gemm_combine") is None
    with_settings(moe_fused="1")
    with cm.override_ops(("moe_gemm_combine",), "serial"):
        assert cm.overlap_override("moe_gemm_combine") == "serial"
        assert cm.overlap_override("moe_dispatch_gemm") == "fused"  # the setting
        with cm.override_ops(("moe_gemm_combine", "ulysses_attn"), "fused"):
            assert cm.overlap_override("moe_gemm_combine") == "fused"
            assert cm.overlap_override("ulysses_attn") == "fused"
        assert cm.overlap_override("ulysses_attn") is None
    with_settings(moe_fused="yes")
    with pytest.raises(ValueError, match="PK_JAX_MOE_FUSED='yes' is not one of auto, 0, 1"):
        cm.overlap_override("moe_dispatch_gemm")
    with pytest.raises(ValueError, match="ring_attn"), cm.override_ops(("ring_attn",), "fused"):
        pass
    with pytest.raises(ValueError, match="'both'"), cm.override_ops(("ulysses_attn",), "both"):
        pass
