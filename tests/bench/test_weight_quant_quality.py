"""The weight-quantization quality study's own parts (nothing heavy runs)."""

from bench.quality.weight_quant_quality import render_comparison


def test_the_scheme_comparison_renders_a_month_without_changed_labels():
    quality = {"accuracy": 0.75, "accuracy_new": None, "accuracy_regression": None, "perplexity": 2.5}
    table = render_comparison({"int4_rtn": {"quality": quality, "calib_error": {"kl_mean": 1e-4, "top1_agreement": 0.95}}})
    assert "| int4_rtn | 1.00e-04 | 0.9500 | 0.7500 | n/a | n/a | 2.5000 | - |" in table
