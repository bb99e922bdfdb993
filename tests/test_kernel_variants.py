"""GPU-free: benchmarks.kernel_variants edits a copy of the headers exactly as asked, and
refuses an edit that does not apply once."""

import pytest

from benchmarks import kernel_variants
from cuda_templates import compiler


def test_each_edit_applies_once_in_order():
    text = "a = 1;\nb = 2;\n"
    assert kernel_variants.edit_header(text, [("a = 1", "a = 3"), ("a = 3;\nb", "c")], "h") == "c = 2;\n"
    with pytest.raises(ValueError, match="'x = 1' occurs 0 times"):
        kernel_variants.edit_header(text, [("x = 1", "y")], "h")
    with pytest.raises(ValueError, match="occurs 2 times"):
        kernel_variants.edit_header(text, [(" = ", "=")], "h")


def test_variants_are_a_name_and_pairs():
    assert kernel_variants.parse_variants([["tree"], ["cut", "old", "new", "o2", "n2"]]) == {
        "tree": [], "cut": [("old", "new"), ("o2", "n2")]}
    with pytest.raises(ValueError, match="OLD NEW pairs"):
        kernel_variants.parse_variants([["odd", "old"]])
    with pytest.raises(ValueError, match="given twice"):
        kernel_variants.parse_variants([["a"], ["a"]])


def test_the_edited_copy_leaves_the_tree_alone(tmp_path):
    header = compiler.INCLUDE_DIR / "fusedepi" / "conv_sm90.cuh"
    before = header.read_text()
    old = "constexpr int kRunSlot = kTW + kOutV;"
    include = kernel_variants.edited_include(tmp_path, "conv_sm90.cuh", [(old, "constexpr int kRunSlot = kTW;")])
    edited = (include / "fusedepi" / "conv_sm90.cuh").read_text()
    assert edited == before.replace(old, "constexpr int kRunSlot = kTW;") and header.read_text() == before
    assert (include / "fusedepi" / "hopper.cuh").read_text() == (compiler.INCLUDE_DIR / "fusedepi" / "hopper.cuh").read_text()
    with pytest.raises(ValueError, match="no header"):
        kernel_variants.edited_include(tmp_path / "other", "nonexistent.cuh", [])


def test_a_bad_edit_stops_the_command_before_any_run(capsys):
    with pytest.raises(SystemExit) as stop:
        kernel_variants.main(["--variant", "cut", "not in the header", "x", "--models", "conv2d_relu_bias"])
    assert stop.value.code == 2
    assert "occurs 0 times" in capsys.readouterr().err


@pytest.mark.parametrize("preset", sorted(kernel_variants.PRESETS))
def test_each_presets_edits_apply_once_to_its_header_as_it_stands(preset):
    header, variants = kernel_variants.PRESETS[preset]
    text = (compiler.INCLUDE_DIR / "fusedepi" / header).read_text()
    assert "tree" in variants and not variants["tree"]  # the tree's kernel beside the cuts
    for name, pairs in variants.items():
        edited = kernel_variants.edit_header(text, pairs, header)  # raises where an edit no longer applies
        assert (edited == text) == (not pairs), name


def test_a_preset_then_the_variants_given_by_hand():
    header, variants = kernel_variants.chosen_variants("conv-parts", [["mine", "old", "new"]], "other.cuh")
    assert header == "conv_sm90.cuh"
    assert list(variants) == [*kernel_variants.PRESETS["conv-parts"][1], "mine"] and variants["mine"] == [("old", "new")]
    assert kernel_variants.chosen_variants(None, [["tree"]], "gemm_sm90.cuh") == ("gemm_sm90.cuh", {"tree": []})
    with pytest.raises(ValueError, match="given twice"):
        kernel_variants.chosen_variants("conv-parts", [["tree"]], "conv_sm90.cuh")
    with pytest.raises(ValueError, match="no variant"):
        kernel_variants.chosen_variants(None, None, "conv_sm90.cuh")
    with pytest.raises(ValueError, match="no preset"):
        kernel_variants.chosen_variants("nonexistent", None, "conv_sm90.cuh")


def test_plan_settings_are_conv_sm90_constants_as_literals(capsys):
    from cuda_templates import conv_sm90

    before = conv_sm90.K_STEP_BYTES
    plan = kernel_variants.parse_plan(["K_STEP_BYTES=(32, 64, 128)", "SHARED_ROWS = False"])
    assert plan == {"K_STEP_BYTES": (32, 64, 128), "SHARED_ROWS": False}
    assert conv_sm90.K_STEP_BYTES == before  # parsed only: set in the variant's own process
    for bad, why in (("SHARED_ROWS", "NAME=VALUE"), ("NO_SUCH=1", "upper-case constant"), ("tiling=1", "upper-case"),
                     ("MAX_PATCH_W=sixty", "not a Python literal")):
        with pytest.raises(ValueError, match=why):
            kernel_variants.parse_plan([bad])
    with pytest.raises(ValueError, match="given twice"):
        kernel_variants.parse_plan(["MIN_STAGES=2", "MIN_STAGES=3"])
    with pytest.raises(SystemExit) as stop:  # a bad setting stops the command before any run
        kernel_variants.main(["--variant", "tree", "--plan", "NO_SUCH=1", "--models", "conv2d_relu_bias"])
    assert stop.value.code == 2 and "upper-case constant" in capsys.readouterr().err


def test_a_test_run_sets_conv_sm90_constants_from_its_environment(monkeypatch):
    # FUSEDEPI_TEST_CONV_PLAN (tests/conv_plan.py): --plan's items for a whole pytest or
    # fuzzer run; unset, nothing is set.
    import conv_plan
    from cuda_templates import conv_sm90

    set_here = []
    monkeypatch.delenv(conv_plan.ENV, raising=False)
    assert conv_plan.apply_from_env(lambda *a: set_here.append(a)) == {} and not set_here
    monkeypatch.setenv(conv_plan.ENV, "WINDOW_BOX=True  PAD_PIXELS=True")
    assert conv_plan.apply_from_env(lambda *a: set_here.append(a)) == {"WINDOW_BOX": True, "PAD_PIXELS": True}
    assert set_here == [(conv_sm90, "WINDOW_BOX", True), (conv_sm90, "PAD_PIXELS", True)]
    monkeypatch.setenv(conv_plan.ENV, "WINDOW_BOX")
    with pytest.raises(ValueError, match="NAME=VALUE"):
        conv_plan.apply_from_env(lambda *a: None)
