"""Tests for minimoe.evaluation.diagnostics: each test names the equation, reference or bad input it checks."""

import json
import math
import statistics

import numpy as np
import pytest

from minimoe.evaluation import diagnostics
from minimoe.evaluation.diagnostics import (Groups, accuracy_table, average_groups_across_seeds, average_ranks,
                                            collect_metrics, concentration_summary, decile_curve,
                                            error_prediction_summary, group_by_layer_token, pearson,
                                            plot_error_prediction, population_moments, seed_error_figure, spearman)


def reference_pearson(x, y):
    """Eq. diagnostic_concentration_loss_correlation written out term by term in plain Python."""
    mx, my = sum(x) / len(x), sum(y) / len(y)
    num = sum((a - mx) * (b - my) for a, b in zip(x, y))
    den = math.sqrt(sum((a - mx) ** 2 for a in x)) * math.sqrt(sum((b - my) ** 2 for b in y))
    return num / den


def reference_average_ranks(x):
    """Rank i counts the values below plus the mean position among equal values."""
    return [sum(v < a for v in x) + (sum(v == a for v in x) + 1) / 2 for a in x]


# ---- correlations -------------------------------------------------------------------------------

def test_pearson_matches_direct_formula():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=50), rng.normal(size=50)
    y = y + 0.5 * x
    assert pearson(x, y) == pytest.approx(reference_pearson(list(x), list(y)), abs=1e-12)


def test_pearson_is_one_on_perfectly_linear_data_and_minus_one_when_decreasing():
    x = np.linspace(-3.0, 7.0, 31)
    # Exact to rounding only; the clamp in pearson keeps |r| <= 1.
    assert pearson(x, 2.5 * x + 1.0) == pytest.approx(1.0, abs=1e-12)
    assert pearson(x, -0.1 * x + 4.0) == pytest.approx(-1.0, abs=1e-12)
    assert abs(pearson(x, 1e-3 * x)) <= 1.0


def test_pearson_is_undefined_not_zero_for_constant_or_too_short_input():
    # The paper: "the denominator is zero and the correlation is undefined, rather than zero".
    assert math.isnan(pearson([0.1, 0.1, 0.1], [1.0, 2.0, 3.0]))
    assert math.isnan(pearson([1.0, 2.0, 3.0], [5.0, 5.0, 5.0]))
    assert math.isnan(pearson([1.0], [2.0]))
    assert math.isnan(spearman([4.0, 4.0, 4.0], [1.0, 3.0, 2.0]))


def test_pearson_rejects_bad_input():
    with pytest.raises(ValueError, match="differ in length"):
        pearson([1.0, 2.0], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="NaN"):
        pearson([1.0, float("nan")], [1.0, 2.0])


def test_average_ranks_share_the_mean_rank_on_ties():
    x = [3.0, 1.0, 3.0, 2.0, 3.0, 1.0]
    assert average_ranks(x).tolist() == reference_average_ranks(x) == [5.0, 1.5, 5.0, 3.0, 5.0, 1.5]


def test_spearman_is_pearson_of_average_ranks_with_ties():
    x = [1.0, 2.0, 2.0, 3.0, 4.0, 4.0, 4.0, 7.0]
    y = [0.3, 0.1, 0.9, 0.9, 0.5, 2.0, 1.0, 3.0]
    expected = reference_pearson(reference_average_ranks(x), reference_average_ranks(y))
    assert spearman(x, y) == pytest.approx(expected, abs=1e-12)
    # Any strictly increasing map of x leaves the ranks, hence rho, unchanged.
    assert spearman(np.exp(x), y) == pytest.approx(expected, abs=1e-12)


def test_correlations_agree_with_scipy_when_installed():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(1)
    x = rng.integers(0, 6, size=200).astype(float)  # many ties
    y = x + rng.normal(size=200)
    assert pearson(x, y) == pytest.approx(stats.pearsonr(x, y)[0], abs=1e-12)
    assert spearman(x, y) == pytest.approx(stats.spearmanr(x, y)[0], abs=1e-12)


# ---- affinity concentration ---------------------------------------------------------------------

def test_n_eff_is_reciprocal_of_mean_concentration_not_mean_of_reciprocals():
    # Eq. diagnostic_split_concentration. C = (1, 1/8): 1/mean = 1/0.5625 = 1.777..., while
    # mean(1/C) = (1 + 8)/2 = 4.5, so the wrong order would be caught.
    summary = concentration_summary([1.0, 0.125], [2.0, 1.0])
    assert summary["C_bar"] == pytest.approx(0.5625)
    assert summary["N_eff"] == pytest.approx(1 / 0.5625)
    assert summary["N_eff"] != pytest.approx(4.5)
    assert summary["tokens"] == 2
    assert summary["r"] == pytest.approx(1.0)


def test_concentration_loss_correlation_is_nan_for_constant_loss():
    assert math.isnan(concentration_summary([0.2, 0.5, 0.9], [1.0, 1.0, 1.0])["r"])


# ---- layer--token-identity groups ---------------------------------------------------------------

def test_grouping_averages_contextual_occurrences_per_layer_and_token():
    layer = [0, 0, 1, 0, 1, 0]
    token = [7, 7, 7, 3, 7, 7]
    pred = [1.0, 2.0, 10.0, 5.0, 20.0, 3.0]
    obs = [0.0, 1.0, 4.0, 9.0, 6.0, 2.0]
    groups = group_by_layer_token(layer, token, pred, obs)
    # Groups sorted by (layer, token): (0, 3) one occurrence, (0, 7) three, (1, 7) two.
    assert groups.keys.tolist() == [[0, 3], [0, 7], [1, 7]]
    np.testing.assert_allclose(groups.predicted, [5.0, 2.0, 15.0])
    np.testing.assert_allclose(groups.observed, [9.0, 1.0, 5.0])


def test_seed_average_weights_seeds_equally_and_keeps_partial_groups_unless_asked():
    seed_a = Groups(np.array([1.0, 2.0]), np.array([10.0, 20.0]), np.array([[0, 1], [0, 2]]))
    seed_b = Groups(np.array([3.0, 8.0]), np.array([30.0, 80.0]), np.array([[0, 1], [1, 5]]))
    merged = average_groups_across_seeds([seed_a, seed_b])
    assert merged.keys.tolist() == [[0, 1], [0, 2], [1, 5]]
    np.testing.assert_allclose(merged.predicted, [2.0, 2.0, 8.0])  # (1+3)/2, then present-only
    np.testing.assert_allclose(merged.observed, [20.0, 20.0, 80.0])
    complete = average_groups_across_seeds([seed_a, seed_b], drop_incomplete=True)
    assert complete.keys.tolist() == [[0, 1]]
    np.testing.assert_allclose(complete.predicted, [2.0])


def test_error_prediction_summary_reports_pointwise_and_group_correlations():
    layer = [0, 0, 0, 0, 1, 1]
    token = [1, 1, 2, 2, 1, 1]
    pred = [1.0, 3.0, 4.0, 6.0, 0.0, 1.0]
    obs = [2.0, 0.0, 1.0, 5.0, 0.5, 0.4]
    summary = error_prediction_summary(layer, token, pred, obs)
    assert summary["pointwise_r"] == pytest.approx(reference_pearson(pred, obs))
    group_pred, group_obs = [2.0, 5.0, 0.5], [1.0, 3.0, 0.45]  # (0,1), (0,2), (1,1)
    assert summary["group_r"] == pytest.approx(reference_pearson(group_pred, group_obs))
    assert summary["group_rho"] == pytest.approx(1.0)  # group orders agree exactly
    assert summary["groups"] == 3 and summary["tokens"] == 6


# ---- decile curves ------------------------------------------------------------------------------

def test_deciles_have_equal_counts_and_increasing_means_on_a_monotone_population():
    rng = np.random.default_rng(2)
    pred = rng.permutation(103).astype(float)
    obs = 0.5 * pred + 3.0
    curve = decile_curve(pred, obs)
    assert curve["counts"].sum() == 103
    assert curve["counts"].max() - curve["counts"].min() <= 1
    assert np.all(np.diff(curve["obs_mean"]) > 0)
    assert np.all(np.diff(curve["pred_mean"]) > 0)
    assert curve["pearson"] == pytest.approx(1.0) and curve["spearman"] == pytest.approx(1.0)


def test_decile_standardisation_uses_the_given_reference_unchanged():
    pred = np.arange(20, dtype=float)
    obs = pred**2
    reference = (3.0, 2.0, 50.0, 10.0)  # (pred_mean, pred_std, obs_mean, obs_std) of some train set
    curve = decile_curve(pred, obs, reference=reference, bins=4)
    bins = np.split(np.arange(20), 4)  # pred is already sorted: bins are consecutive fives
    np.testing.assert_allclose(curve["pred_mean"], [((pred[b] - 3.0) / 2.0).mean() for b in bins])
    np.testing.assert_allclose(curve["obs_mean"], [((obs[b] - 50.0) / 10.0).mean() for b in bins])
    se = [statistics.stdev(((obs[b] - 50.0) / 10.0).tolist()) / math.sqrt(5) for b in bins]
    np.testing.assert_allclose(curve["obs_se"], se)


def test_decile_default_reference_is_the_population_itself_with_ddof0():
    pred = np.array([1.0, 2.0, 3.0, 4.0])
    obs = np.array([2.0, 2.0, 4.0, 8.0])
    assert population_moments(pred, obs) == (2.5, statistics.pstdev(pred.tolist()),
                                             4.0, statistics.pstdev(obs.tolist()))
    curve = decile_curve(pred, obs, bins=2)
    assert curve["obs_mean"].mean() == pytest.approx(0.0)  # own moments centre the population


def test_deciles_bin_by_predicted_error_where_the_observed_order_disagrees():
    """Bins follow the predicted order, not the observed one (which would flatter calibration): here
    the two orders disagree, and the bins are written out by hand."""
    pred = [0.8, 0.1, 0.5, 0.3, 0.9, 0.2, 0.7, 0.4]
    obs = [1.0, 5.0, 2.0, 8.0, 0.5, 3.0, 6.0, 4.0]
    # Predicted order: groups 1 (0.1), 5, 3, 7, 2, 6, 0, 4 (0.9). Binned by obs they would be 4, 0, 2, 5, ...
    hand_bins = {4: [[1, 5], [3, 7], [2, 6], [0, 4]], 3: [[1, 5, 3], [7, 2, 6], [0, 4]]}
    reference = (0.5, 0.25, 4.0, 2.0)  # (pred_mean, pred_std, obs_mean, obs_std) of some train set
    for bins, groups in hand_bins.items():
        curve = decile_curve(pred, obs, reference=reference, bins=bins)
        assert curve["counts"].tolist() == [len(g) for g in groups]
        z_pred = [[(pred[i] - 0.5) / 0.25 for i in g] for g in groups]
        z_obs = [[(obs[i] - 4.0) / 2.0 for i in g] for g in groups]
        np.testing.assert_allclose(curve["pred_mean"], [statistics.fmean(z) for z in z_pred])
        np.testing.assert_allclose(curve["obs_mean"], [statistics.fmean(z) for z in z_obs])
        np.testing.assert_allclose(curve["obs_se"], [statistics.stdev(z) / math.sqrt(len(z)) for z in z_obs])
        np.testing.assert_allclose(curve["pred_se"], [statistics.stdev(z) / math.sqrt(len(z)) for z in z_pred])
    # Four bins, raw units: observed means 4, 6, 4, 0.75 (not monotone); binned by obs: 0.75, 2.5, 4.5, 7.
    assert decile_curve(pred, obs, reference=(0.0, 1.0, 0.0, 1.0), bins=4)["obs_mean"].tolist() == [4.0, 6.0, 4.0, 0.75]


def test_decile_curve_rejects_more_bins_than_groups():
    with pytest.raises(ValueError, match="cannot fill"):
        decile_curve([1.0, 2.0], [1.0, 2.0], bins=3)


@pytest.mark.plain
def test_plot_writes_a_png_atomically(tmp_path):
    rng = np.random.default_rng(3)
    train_pred, test_pred = rng.normal(size=60), rng.normal(size=30)
    train_obs, test_obs = train_pred + rng.normal(size=60), test_pred + rng.normal(size=30)
    reference = population_moments(train_pred, train_obs)
    train = decile_curve(train_pred, train_obs, reference=reference)
    test = decile_curve(test_pred, test_obs, reference=reference)
    out = plot_error_prediction(train, test, tmp_path / "fig" / "arc.png", title="ARC")
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000
    assert [p.name for p in out.parent.iterdir()] == ["arc.png"]  # no temp file left behind


def write_seed_tokens(path, rng, *, shift=(0.0, 0.0), layers=(2, 3), tokens=10):
    """A tokens-<split>.npz as evaluate.py writes it: every tes layer's e_hat beside the shared token CE;
    occurrences per token vary, so per-seed group means are not pooled token means. -> its arrays."""
    target = np.repeat(np.arange(tokens), rng.integers(1, 4, tokens))
    ce = rng.gamma(2.0, 1.0, target.size) + shift[1]
    arrays = {"token_ce": ce, "target": target}
    for l in layers:
        arrays[f"e_hat_layer{l}"] = 0.5 * ce + rng.normal(0.0, 0.4, ce.size) + 0.05 * l * target + shift[0]
    np.savez(path, **arrays)
    return arrays


def hand_seed_average(per_seed):
    """(layer, token) -> (mean e_hat, mean CE) over each seed's occurrences, then the plain mean over seeds."""
    means = {}
    for arrays in per_seed:
        layers = [int(k.removeprefix("e_hat_layer")) for k in arrays if k.startswith("e_hat_layer")]
        for l in layers:
            for t in sorted(set(arrays["target"].tolist())):
                at = [i for i, x in enumerate(arrays["target"].tolist()) if x == t]
                means.setdefault((l, t), []).append((statistics.fmean(arrays[f"e_hat_layer{l}"][i] for i in at),
                                                     statistics.fmean(arrays["token_ce"][i] for i in at)))
    return {key: tuple(statistics.fmean(v[j] for v in vals) for j in (0, 1)) for key, vals in means.items()}


def test_seed_figure_standardises_both_populations_with_the_train_groups_moments(tmp_path, monkeypatch):
    """fig:arc_error_prediction over two seeds, with test shifted from train (e_hat +1, CE +3): the
    plotted curves are the seed-averaged groups binned by predicted error, both standardised with the
    TRAIN groups' population moments, recomputed here in plain Python. With the test groups' own
    moments the shift would vanish from the figure."""
    rng = np.random.default_rng(7)
    train_files, test_files, train, test = [], [], [], []
    for seed in (42, 43):
        train_files.append(tmp_path / f"train-{seed}.npz")
        test_files.append(tmp_path / f"test-{seed}.npz")
        train.append(write_seed_tokens(train_files[-1], rng))
        test.append(write_seed_tokens(test_files[-1], rng, shift=(1.0, 3.0)))
    plotted = {}
    real_plot = diagnostics.plot_error_prediction

    def spy(train_curve, test_curve, path, **kw):  # the curves exactly as they are drawn
        plotted.update(train=train_curve, test=test_curve)
        return real_plot(train_curve, test_curve, path, **kw)
    monkeypatch.setattr(diagnostics, "plot_error_prediction", spy)
    stats = seed_error_figure(train_files, test_files, tmp_path / "fig.png", title="ARC")
    assert (tmp_path / "fig.png").read_bytes().startswith(b"\x89PNG")

    train_groups, test_groups = hand_seed_average(train), hand_seed_average(test)
    assert len(train_groups) == len(test_groups) == 20  # 2 layers x 10 tokens: bins of two
    pred_values = [p for p, _ in train_groups.values()]
    obs_values = [o for _, o in train_groups.values()]
    pred_mu, pred_sd = statistics.fmean(pred_values), statistics.pstdev(pred_values)
    obs_mu, obs_sd = statistics.fmean(obs_values), statistics.pstdev(obs_values)
    for name, groups in (("train", train_groups), ("test", test_groups)):
        ranked = sorted(groups.values(), key=lambda po: po[0])  # by predicted error
        bins = [ranked[i:i + 2] for i in range(0, 20, 2)]
        curve = plotted[name]
        np.testing.assert_allclose(curve["pred_mean"], [statistics.fmean((p - pred_mu) / pred_sd for p, _ in b)
                                                        for b in bins], rtol=1e-12, err_msg=name)
        np.testing.assert_allclose(curve["obs_mean"], [statistics.fmean((o - obs_mu) / obs_sd for _, o in b)
                                                       for b in bins], rtol=1e-12, err_msg=name)
        np.testing.assert_allclose(curve["obs_se"], [statistics.stdev([(o - obs_mu) / obs_sd for _, o in b]) / math.sqrt(2)
                                                     for b in bins], rtol=1e-12, err_msg=name)
        pred, obs = zip(*groups.values())
        assert stats[name]["group_r"] == pytest.approx(reference_pearson(pred, obs), abs=1e-12)
    # The shift shows: the test curve sits (3 / obs_sd) train standard deviations above the train one.
    assert plotted["test"]["obs_mean"].mean() - plotted["train"]["obs_mean"].mean() > 1.0


# ---- accuracy report ----------------------------------------------------------------------------

def write_metrics(root, name, **record):
    path = root / name / "metrics.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(record))
    return path


def expected_cell(accuracies):
    percent = [100 * a for a in accuracies]
    return f"{statistics.mean(percent):.2f} ± {statistics.stdev(percent):.2f}"


def test_accuracy_table_gives_mean_and_sample_std_cells_in_first_appearance_order(tmp_path):
    ce_arc = {42: 0.64, 43: 0.6733, 45: 0.6667}
    for seed, acc in ce_arc.items():
        write_metrics(tmp_path, f"a_ce_arc_{seed}", model="granite", method="CE",
                      dataset="ARC-Challenge", seed=seed, accuracy=acc)
    for seed, acc in {42: 0.70, 43: 0.72}.items():  # one seed missing
        write_metrics(tmp_path, f"b_ce_obqa_{seed}", model="granite", method="CE",
                      dataset="OpenBookQA", seed=seed, accuracy=acc)
    write_metrics(tmp_path, "c_tes_arc_42", model="granite", method="TES-IS",
                  dataset="ARC-Challenge", seed=42, accuracy=0.68)
    write_metrics(tmp_path, "d_ce_arc_44", model="granite", method="CE",  # not a table seed
                  dataset="ARC-Challenge", seed=44, accuracy=0.10)
    records = collect_metrics([tmp_path])
    assert len(records) == 7
    lines = accuracy_table(records).splitlines()
    assert lines[0] == "| Model | Method | ARC-Challenge | OpenBookQA |"
    assert lines[1] == "|---|---|---|---|"
    assert lines[2] == (f"| granite | CE | {expected_cell(list(ce_arc.values()))} | "
                        f"{expected_cell([0.70, 0.72])} (n=2) |")
    assert lines[3] == "| granite | TES-IS | 68.00 (n=1) | — |"
    assert len(lines) == 4


def test_accuracy_table_shows_a_model_folder_by_name_in_full_only_when_two_share_it():
    rec = dict(method="CE", dataset="SciQ", seed=42, accuracy=0.5)
    lines = accuracy_table([dict(rec, model="/home/u/weights/smollm2-moe"), dict(rec, model="ibm/granite")]).splitlines()
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| smollm2-moe", "| granite"]
    lines = accuracy_table([dict(rec, model="/a/m"), dict(rec, model="/b/m")]).splitlines()
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| /a/m", "| /b/m"]  # two different models


def test_duplicate_runs_raise(tmp_path):
    for name in ("run1", "run2"):
        write_metrics(tmp_path, name, model="olmoe", method="CE", dataset="SciQ", seed=42,
                      accuracy=0.88)
    with pytest.raises(ValueError, match="duplicate run .*seed=42"):
        accuracy_table(collect_metrics([tmp_path]))


def test_missing_key_raises_naming_file_and_key(tmp_path):
    path = write_metrics(tmp_path, "run", model="olmoe", method="CE", dataset="SciQ", seed=42)
    with pytest.raises(ValueError, match=r"metrics\.json: missing required key 'accuracy'"):
        collect_metrics([path])


def test_percent_accuracy_is_rejected(tmp_path):
    path = write_metrics(tmp_path, "run", model="olmoe", method="CE", dataset="SciQ", seed=42,
                         accuracy=88.4)
    with pytest.raises(ValueError, match="fraction"):
        collect_metrics([path])
