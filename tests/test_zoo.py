"""GPU-free: the zoo's models build and run (one sample each), fuse their whole chains (through the
fused op's reference), and the command line lists them."""

import os
import subprocess
import sys

import pytest
import torch

from benchmarks import zoo


def test_the_zoo_has_forty_models_of_distinct_names():
    assert len(zoo.MODELS) >= 40 and len(zoo.BY_NAME) == len(zoo.MODELS)
    assert set(zoo.QUICK) <= set(zoo.BY_NAME)


@pytest.mark.parametrize("name", list(zoo.BY_NAME))
def test_each_model_runs_one_sample(name):
    model = zoo.BY_NAME[name].make()
    x = torch.rand((2,) + zoo.BY_NAME[name].shape[1:])  # two: BatchNorm in training needs them
    with torch.no_grad():
        out = model(x)
    assert torch.isfinite(out).all()


def test_wall_times_are_taken_in_turns(monkeypatch):
    """`interleaved_ms` times the compiles a round each in turn (`timings.in_turns`), as
    a user's loop calls them: 3 calls each to warm up, then rounds of `calls` calls."""
    from fusion_backend import timings

    order = []
    # Each round's "time": a host that slows down from round to round, whoever runs.
    monkeypatch.setattr(timings, "cuda_round_ms", lambda fn, calls: (order.append((fn(), calls)), float(len(order)))[1])
    medians = zoo.interleaved_ms({"inductor": lambda: "a", "fusedepi": lambda: "b"}, calls=20, rounds=4)
    assert order == [("a", 3), ("b", 3), ("a", 20), ("b", 20), ("b", 20), ("a", 20),
                     ("a", 20), ("b", 20), ("b", 20), ("a", 20)]
    # Rounds 3..10: a's are 3, 6, 7, 10 and b's 4, 5, 8, 9: the same medians.
    assert medians == {"inductor": 6.5, "fusedepi": 6.5}


def test_chains_prints_where_each_chain_stops():
    """`--chains` runs the matcher alone (here through the reference): a line per fused
    chain and its stop, one per anchor left alone."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.zoo", "--chains", "--models", "conv2d_relu",
                          "linear_sigmoid_linear_logsumexp", "--dtypes", "float32"],
                         capture_output=True, text=True, check=True)
    lines = [line.split(None, 2) for line in out.stdout.splitlines()]
    assert lines == [
        ["conv2d_relu", "float32", "fused conv_pointwise: stops at end of the graph"],
        ["conv2d_relu", "float32", "in-kernel conv on sm_90: not taken: the direct conv covers it"],
        ["linear_sigmoid_linear_logsumexp", "float32",
         "fused linear_pointwise: stops at addmm_1 is the next matrix op (addmm.default), an anchor of its own"],
        ["linear_sigmoid_linear_logsumexp", "float32", "fused linear_logsumexp: stops at end of the graph"]]


def test_chains_names_the_in_kernel_tiling_a_plan_changes():
    """With --plan, `--chains` shows each conv chain's in-kernel tiling with the plan and,
    where the plan changes it, without (the rows to time): 3 bf16 input channels are
    refused unless x's pixels are padded (conv_sm90.PAD_PIXELS, on by default); 64 -> 128
    channels are tiled alike either way."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.zoo", "--chains", "--plan", "PAD_PIXELS=False", "--models",
                          "resnet_stem_bn_relu", "conv2d_relu_bias", "--dtypes", "bfloat16"],
                         capture_output=True, text=True, check=True)
    tilings = [line.split(None, 2)[2] for line in out.stdout.splitlines() if "in-kernel conv on sm_90" in line]
    assert len(tilings) == 2
    stem, wide = tilings
    assert stem.startswith("in-kernel conv on sm_90: not taken: 3 -> 64 channels")
    assert stem.endswith("x's pixels padded to 8 channels)") and "(without --plan: tiles of 64 channels" in stem
    assert wide.startswith("in-kernel conv on sm_90: tiles of 128 channels") and wide.endswith(
        "(the same without --plan)")


def test_list_prints_one_name_a_line():
    out = subprocess.run([sys.executable, "-m", "benchmarks.zoo", "--list"], capture_output=True, text=True, check=True)
    assert out.stdout.split() == list(zoo.BY_NAME)


def test_anchor_splits_the_zoo_into_conv_and_gemm_models():
    out = subprocess.run([sys.executable, "-m", "benchmarks.zoo", "--list", "--anchor", "conv"], capture_output=True,
                         text=True, check=True)
    conv = out.stdout.split()
    assert {"conv2d_relu", "convtranspose3d_residual", "conv1d_bn_gelu", "unet_resblock_time_embedding"} <= set(conv)
    gemm = [n for n in zoo.BY_NAME if n not in conv]
    assert {"mlp_gelu", "bmm_scores_softmax", "linear_sigmoid_linear_logsumexp"} <= set(gemm)
    assert all(zoo.anchor_kind(n) == "gemm" for n in gemm)


def test_the_ncu_target_takes_zoo_models_as_well_as_workloads():
    from benchmarks import once

    model, x = once.model_and_input("conv2d_relu", torch.bfloat16, train=True, device="cpu")
    assert model.training and x.shape == zoo.BY_NAME["conv2d_relu"].shape and x.dtype == torch.bfloat16
    assert next(model.parameters()).dtype == torch.bfloat16
    with pytest.raises(SystemExit):  # argparse: neither a workload nor a zoo model
        once.main(["no_such_model", "bf16"])


def test_the_wall_target_times_both_backends_and_profiles_the_fused_calls(monkeypatch, capsys):
    # `once --wall` (device_run.sh wall): each backend's wall ms a call over alternating
    # rounds, then cProfile's table of the fused calls (here without a GPU or a compile).
    from benchmarks import once

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch, "compile", lambda model, **kw: model)
    model, x = torch.nn.Linear(4, 4), torch.rand(2, 4)
    calls = []
    once.wall(model, x, lambda t: calls.append(t) or model(t), rounds=2, calls=3)
    out = capsys.readouterr().out
    assert [line.split()[:2] for line in out.splitlines() if " wall " in line] == [["fusedepi", "wall"],
                                                                                  ["inductor", "wall"]]
    assert "rounds: " in out and "function calls" in out and "tottime" in out
    assert len(calls) == 2 * (1 + 3) + 3  # two rounds (a warm-up call and 3 each), then 3 profiled


def _row(model, dtype, gpu_ratio, ratio, fused=()):
    return {"model": model, "dtype": dtype, "inductor_gpu_ms": gpu_ratio * 0.1, "fusedepi_gpu_ms": 0.1,
            "gpu_ratio": gpu_ratio, "ratio": ratio, "fused": list(fused), "refused": [] if fused else ["conv: why"]}


def test_the_results_tables_from_two_shards(tmp_path):
    """`--table` joins the shards' rows in the zoo's order, and summarizes each dtype: GPU
    time and wall (min / geometric mean / below 0.97x, and of those the rows that fused a
    chain), and the models that fused."""
    import json

    first, second = list(zoo.BY_NAME)[:2]
    shards = [{"rows": [_row(second, "float32", 2.0, 0.95, ["conv_pointwise (fused 1 ms)"])]},
              {"rows": [_row(first, "float32", 0.5, 0.9), _row(first, "bfloat16", 1.0, 1.0)]}]
    paths = []
    for i, shard in enumerate(shards):
        paths.append(tmp_path / f"zoo_{i}.json")
        paths[-1].write_text(json.dumps(shard))
    run = subprocess.run([sys.executable, "-m", "benchmarks.zoo", "--table", *map(str, paths)],
                         capture_output=True, text=True, check=True)
    lines = run.stdout.splitlines()
    # below 0.97x: how many, and of them the rows that ran a graph of fusedepi's
    assert lines[2] == "| float32 | 2 | 0.50 / 1.000 / 1 (0 fused) | 0.90 / 0.925 / 2 (1 fused) | 1 models | 2.00 / 2.000 |"
    assert lines[3] == "| bfloat16 | 1 | 1.00 / 1.000 / 0 | 1.00 / 1.000 / 0 | 0 models | - |"
    # the same summaries by anchor (both models hold a conv)
    assert [zoo.anchor_kind(first), zoo.anchor_kind(second)] == ["conv", "conv"]
    assert lines[7:9] == ["| conv | float32 | 2 | 0.50 / 1.000 / 1 (0 fused) | 0.90 / 0.925 / 2 (1 fused) |",
                          "| conv | bfloat16 | 1 | 1.00 / 1.000 / 0 | 1.00 / 1.000 / 0 |"]
    rows = [line.split(" | ")[:2] for line in lines[12:]]
    assert rows == [[f"| {first}", "float32"], [f"| {first}", "bfloat16"], [f"| {second}", "float32"]]
    assert lines[-1].endswith("| 2.00 | 0.95 | conv_pointwise (fused 1 ms) |")
    with pytest.raises(ValueError, match="in more than one run"):
        zoo.markdown(shards + shards[:1])
    assert "runs stopped" not in run.stdout
    stopped = zoo.markdown([{**shards[0], "complete": False}, {**shards[1], "complete": True}])
    assert stopped.splitlines()[-1].startswith("1 of the 2 runs stopped before their last model")


def test_json_holds_the_rows_so_far_while_the_run_goes_on(monkeypatch, tmp_path):
    """`--json` is rewritten after every model (complete: false until the end), so that a
    run stopped at a time limit leaves the rows it finished."""
    import json

    path = tmp_path / "zoo.json"
    first, second = list(zoo.BY_NAME)[:2]
    seen = []

    def run_model(model, dtype_name, profile=False):
        seen.append(json.loads(path.read_text()) if path.exists() else None)
        return {**_row(model.name, dtype_name, 1.5, 1.2), "inductor_ms": 0.12, "fusedepi_ms": 0.1,
                "fusedepi_error": 1e-6, "inductor_error": 1e-6, "fusedepi_compile_s": 1.0, "inductor_compile_s": 1.0}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    monkeypatch.setattr(zoo, "run_model", run_model)
    assert zoo.main(["--models", first, second, "--dtypes", "float32", "--json", str(path)]) == 0
    assert seen[0] is None and seen[1]["complete"] is False and [r["model"] for r in seen[1]["rows"]] == [first]
    done = json.loads(path.read_text())
    assert done["complete"] is True and [r["model"] for r in done["rows"]] == [first, second]
    assert done["gpu_summary"]["float32"]["models"] == 2 and not list(tmp_path.glob("*.partial"))


def test_plan_sets_conv_sm90_constants_for_the_run_and_the_json_records_them(monkeypatch, tmp_path, capsys):
    """`--plan NAME=VALUE` (kernel_variants' items) sets conv_sm90's constants in this
    process (and the warm and GPU processes', `_warm_worker`, `_time_on_gpus`); the --json
    result names them; a bad item stops the run before any model."""
    import json

    from cuda_templates import conv_sm90

    monkeypatch.setattr(conv_sm90, "WINDOW_BOX", conv_sm90.WINDOW_BOX)  # restored after the test
    monkeypatch.setattr(zoo, "PLAN", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    windows = []

    def run_model(model, dtype_name, profile=False):
        windows.append(conv_sm90.WINDOW_BOX)
        return {**_row(model.name, dtype_name, 1.5, 1.2), "inductor_ms": 0.12, "fusedepi_ms": 0.1,
                "fusedepi_error": 1e-6, "inductor_error": 1e-6, "fusedepi_compile_s": 1.0, "inductor_compile_s": 1.0}

    monkeypatch.setattr(zoo, "run_model", run_model)
    path = tmp_path / "zoo.json"
    name = list(zoo.BY_NAME)[0]
    assert conv_sm90.WINDOW_BOX  # the default; the plan switches it off
    assert zoo.main(["--models", name, "--dtypes", "float32", "--plan", "WINDOW_BOX=False", "--json", str(path)]) == 0
    assert windows == [False] and json.loads(path.read_text())["plan"] == {"WINDOW_BOX": "False"}
    assert "conv_sm90 set: WINDOW_BOX=False" in capsys.readouterr().out
    assert zoo.main(["--models", name, "--plan", "NO_SUCH=1"]) == 2
    assert "upper-case constant" in capsys.readouterr().err and windows == [False]


# Zoo models with a chain that does not fuse whole, with the reason it stops or is refused.
PARTIAL = {
    # The conv chain fuses whole (BatchNorm, ReLU, the channel means; the ReLU's value also
    # returned for the gate's multiply); the gate's Linear stops at its unsqueezes.
    "se_conv_block": "unsqueeze.default is not in the vocabulary",
    "convnext_block": "permute.default is not in the vocabulary",  # its second Linear, then the permute back
    # The time embedding's Linear only feeds the conv chain's operand, through unsqueezes
    # (the conv chain fuses whole, its [N, C, 1, 1] operand a BROADCAST one).
    "unet_resblock_time_embedding": "no epilogue to fuse: unsqueeze.default is not in the vocabulary",
    "unet_adagn_film": "no epilogue to fuse: split.Tensor is not in the vocabulary",  # (its scale and shift)
    # Its two MLP Linears fuse whole (the second with the per-sample gate and the residual);
    # the adaLN Linear's output is split into shift, scale and gate.
    "dit_mlp_gated_residual": "no epilogue to fuse: split.Tensor is not in the vocabulary",
    # The LayerNorm ends the chain; the permute back to channels-first is a view the graph keeps.
    "convnext_stem_layernorm2d": "permute.default is not in the vocabulary",
}
# Where a chain may end and still be whole: the graph's output, or the next matrix op.
WHOLE = ("end of the graph", "is the next matrix op")


@pytest.mark.parametrize("name", list(zoo.BY_NAME))
def test_each_model_fuses_its_whole_chain(name, cpu_reference):
    """Every zoo model's chains fuse to their end (through the fused op's reference on the
    CPU, at batch 2), but those PARTIAL names with the reason, and the model still
    computes what eager computes."""
    from helpers import compile_records

    torch.manual_seed(0)
    model = zoo.BY_NAME[name].make()
    x = torch.rand((2,) + zoo.BY_NAME[name].shape[1:])
    with torch.no_grad():
        out, fused, refused = compile_records(model, x)
        expected = model(x)
    assert fused or name in PARTIAL, [r.reason for r in refused]
    stops = [r.stop for r in fused] + [r.reason for r in refused]
    if name in PARTIAL:
        assert any(PARTIAL[name] in stop for stop in stops), stops
    else:  # (a refusal: the Linear that computes a bmm's operand)
        assert all(stop.startswith(WHOLE[0]) or WHOLE[1] in stop for stop in stops), stops
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(zoo.BY_NAME))
def test_each_model_fuses_as_much_at_a_symbolic_batch(name, cpu_reference):
    """A call at batch 3, then at batch 2: Dynamo compiles the second graph with a symbolic
    batch size (a user's smaller last batch), and fusedepi fuses the same chains in it,
    refuses the same ones for the same reasons, and computes what eager computes."""
    from fusion_backend import fusedepi
    from fusion_backend.backend import collect_reports

    torch.manual_seed(0)
    model = zoo.BY_NAME[name].make()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=fusedepi)
    static, symbolic = [], []
    with torch.no_grad():
        with collect_reports(static):
            compiled(torch.rand((3,) + zoo.BY_NAME[name].shape[1:]))
        x = torch.rand((2,) + zoo.BY_NAME[name].shape[1:])
        with collect_reports(symbolic):
            out = compiled(x)
        expected = model(x)
    assert len(symbolic) == 1, "no graph compiled for the second batch size"

    def outcome(reports):
        records = [r for report in reports for r in report.records]
        return sorted(r.status for r in records), sorted(r.reason for r in records if r.status == "refused")

    assert outcome(symbolic) == outcome(static)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)


def test_gpu_shards_split_the_models_over_the_visible_gpus():
    names = [f"m{i}" for i in range(7)]
    assert zoo.gpu_shards(names, 3, None) == [("0", ["m0", "m3", "m6"]), ("1", ["m1", "m4"]), ("2", ["m2", "m5"])]
    # the GPUs this process sees, by their names in CUDA_VISIBLE_DEVICES
    assert zoo.gpu_shards(names[:2], 4, "4, 5,6,7") == [("4", ["m0"]), ("5", ["m1"])]
    with pytest.raises(ValueError, match="names 2"):
        zoo.gpu_shards(names, 3, "0,1")


def test_rows_of_the_gpu_processes_merge_in_the_models_order(tmp_path):
    import json

    def row(model, dtype):
        return {"model": model, "dtype": dtype, "ratio": 1.0}

    first, second, missing = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    first.write_text(json.dumps({"complete": True, "rows": [row("m2", "float32"), row("m0", "bfloat16"),
                                                           row("m0", "float32")]}))
    second.write_text(json.dumps({"complete": False, "rows": [row("m1", "float32")]}))
    rows, complete = zoo.merged_rows([str(first), str(second)], ["m0", "m1", "m2"], ["float32", "bfloat16"])
    assert [(r["model"], r["dtype"]) for r in rows] == [("m0", "float32"), ("m0", "bfloat16"), ("m1", "float32"),
                                                       ("m2", "float32")]
    assert not complete  # the second process stopped before its last model
    second.write_text(json.dumps({"complete": True, "rows": [row("m1", "float32")]}))
    assert zoo.merged_rows([str(first), str(second)], ["m0", "m1", "m2"], ["float32"])[1]
    # a process that wrote no file (it timed no model) leaves the run incomplete
    assert not zoo.merged_rows([str(first), str(missing)], ["m0"], ["float32"])[1]


def test_the_timed_pass_on_gpus_runs_a_process_a_gpu_and_writes_their_rows(tmp_path, monkeypatch):
    """`_time_on_gpus` with a stand-in for the processes: each is started on its GPU with
    its models, and the --json file holds the rows of all, in the models' order."""
    import argparse
    import json
    import subprocess

    started, commands = [], []

    class Process:
        def __init__(self, cmd, env):
            started.append((env["CUDA_VISIBLE_DEVICES"], cmd[cmd.index("--models") + 1:cmd.index("--dtypes")]))
            commands.append(cmd)
            path = cmd[cmd.index("--json") + 1]
            models = cmd[cmd.index("--models") + 1:cmd.index("--dtypes")]
            rows = [{"model": m, "dtype": "float32", "ratio": 2.0, "gpu_ratio": 1.5, "fused": []} for m in models]
            with open(path, "w") as handle:
                json.dump({"complete": True, "rows": rows}, handle)
            self.returncode = 0

        def poll(self):
            return self.returncode

        def wait(self):
            return self.returncode

    monkeypatch.setattr(subprocess, "Popen", Process)
    monkeypatch.setattr(zoo, "_result", lambda rows, dtypes, complete: {"complete": complete, "rows": rows})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    out = tmp_path / "zoo.json"
    args = argparse.Namespace(gpus=2, dtypes=["float32"], profile=False, json=str(out), plan=["WINDOW_BOX=True"])
    rows, complete = zoo._time_on_gpus(["a", "b", "c"], args)
    assert started == [("0", ["a", "c"]), ("1", ["b"])]
    assert all(cmd[-2:] == ["--plan", "WINDOW_BOX=True"] for cmd in commands)  # each process sets it too
    assert complete and [r["model"] for r in rows] == ["a", "b", "c"]
    assert [r["model"] for r in json.loads(out.read_text())["rows"]] == ["a", "b", "c"]


def test_visible_gpus_names_the_first_n_this_process_sees():
    assert zoo.visible_gpus(2, None) == ["0", "1"]
    assert zoo.visible_gpus(2, "6, 7,3") == ["6", "7"]
    with pytest.raises(ValueError, match="names 1"):
        zoo.visible_gpus(2, "5")


def test_warm_prints_each_compile_as_it_ends_and_spreads_its_processes_over_the_gpus(monkeypatch, capsys):
    """`warm` with an in-process stand-in for the spawn pool: each process starts through
    `_warm_worker` (one CPU thread; the next GPU in turn), a line a compile as it ends
    (failures with their error), and the count at the end."""
    import multiprocessing

    workers = []
    spawn = multiprocessing.get_context("spawn")

    class StandInPool:
        def __init__(self, processes, initializer, initargs):
            for _ in range(processes):
                monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "all")
                initializer(*initargs)
                workers.append((os.environ["CUDA_VISIBLE_DEVICES"], torch.get_num_threads()))

        def imap_unordered(self, fn, tasks):
            return map(fn, tasks)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class Context:
        Pool = StandInPool

        @staticmethod
        def Value(kind, value):
            return spawn.Value(kind, value)

    def warm_one(task):
        assert os.environ["TORCHINDUCTOR_COMPILE_THREADS"] == "1"
        if task[0] == "b":
            return task[0], task[1], "RuntimeError: no", 2.0, ""
        return task[0], task[1], "", 2.0, "inductor 1 s, fusedepi 1 s"

    threads = torch.get_num_threads()
    monkeypatch.setattr(multiprocessing, "get_context", lambda method: Context)
    monkeypatch.setattr(zoo, "_warm", warm_one)
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    try:
        failed = zoo.warm([("a", "float32"), ("b", "bfloat16")], 3, ["4", "5"])
    finally:
        torch.set_num_threads(threads)
    assert failed == 1 and workers == [("4", 1), ("5", 1), ("4", 1)]
    assert "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("[warm] 1/2 a float32: 2 s (inductor 1 s, fusedepi 1 s) (")
    assert lines[1].startswith("[warm] 2/2 b bfloat16: 2 s RuntimeError: no (")
    assert lines[2].startswith("[warm] 2 of 2 compiles in ")


def test_compile_time_starts_cold_then_warm_and_the_warm_start_times_nothing(monkeypatch, capsys):
    """`benchmarks.compile_time`: two new processes on fresh caches of their own. Here on
    the CPU, with the measured choice timing the fused op's reference against Inductor
    (FUSEDEPI_AUTOTUNE=on): the cold start times the chain, the warm one reads the choice
    from the cache and times nothing; neither runs nvcc."""
    from benchmarks import compile_time

    monkeypatch.setenv("FUSEDEPI_CPU_REFERENCE", "1")
    monkeypatch.setenv("FUSEDEPI_AUTOTUNE", "on")
    row = compile_time.measure("linear_ln_relu", "float32")
    cold, warm = row["starts"]
    assert cold["timed_chains"] == 1 and (warm["timed_chains"], warm["timed_graphs"]) == (0, 0)
    assert cold["builds"] == warm["builds"] == 0 and cold["seconds"] > 0 and warm["seconds"] > 0
    assert cold["fused"] + cold["refused"]  # the chain's record came back from the process
    text = compile_time.describe(row)
    # (the cold start times the whole graph too where the chain's reference measured faster
    # than Inductor, which on a loaded CPU it may or may not)
    assert text.startswith("linear_ln_relu") and "warm" in text
    assert f"(0 builds, 1 chains and {cold['timed_graphs']} graphs timed" in text
    assert "(0 builds, 0 chains and 0 graphs timed" in text.split("warm", 1)[1]
    with pytest.raises(SystemExit):
        compile_time.main(["no_such_model"])
    assert "unknown zoo models: ['no_such_model']" in capsys.readouterr().err


def test_compile_time_profile_lists_this_projects_functions_then_where_time_went_itself():
    from benchmarks import compile_time

    stats = {  # (file, line, function): (calls, primitive calls, own s, cumulative s, callers)
        ("/x/fusion_backend/backend.py", 10, "fusedepi"): (1, 1, 0.1, 9.0, {}),
        ("/x/lowering/matcher.py", 5, "match"): (1, 1, 0.2, 1.0, {}),
        ("/y/torch/_inductor/codecache.py", 7, "load"): (1, 1, 3.0, 4.0, {}),
        ("~", 0, "<built-in method time.sleep>"): (1, 1, 5.0, 5.0, {}),
    }
    lines = compile_time._profile_lines(stats, 2)
    assert lines == ["    9.00 s cumulative  fusion_backend/backend.py:10 fusedepi",
                     "    1.00 s cumulative  lowering/matcher.py:5 match",
                     "    5.00 s itself      ~:0 <built-in method time.sleep>",
                     "    3.00 s itself      _inductor/codecache.py:7 load"]


@pytest.mark.parametrize("argv, message", [
    (["--models", "mlp_gelu", "--anchor", "conv"], "nothing selected (0 models, 2 dtypes"),
    (["--anchor", "gemm", "--shard", "3/2"], "--shard 3/2: I/N with 1 <= I <= N"),
    (["--shard", "half"], "--shard half: I/N"),
    (["--models", "mlp_gelu", "--dtypes"], "nothing selected (1 models, 0 dtypes"),
])
def test_a_selection_of_no_rows_is_an_error_not_an_empty_run(argv, message, capsys):
    assert zoo.main(argv) == 2
    assert message in capsys.readouterr().err
