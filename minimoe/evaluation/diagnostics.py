"""Post-hoc diagnostics and the accuracy report: numbers and figures computed from evaluated runs.

Pure numpy + matplotlib (imported lazily, only by the plot); nothing here touches torch, so the
analysis of saved per-token arrays runs anywhere. Inputs are 1-D arrays over token positions.

What each function reproduces (labels from the paper's .tex):
- `pearson`: Eq. diagnostic_concentration_loss_correlation. Undefined, hence NaN (not 0), when
  either side is constant or has fewer than two points, as the paper says.
- `spearman`: Pearson of average ranks (tied values share the mean of their ranks).
- `concentration_summary`: Eq. diagnostic_split_concentration and the correlation above.
  N_eff = 1 / mean(C_t), NOT mean(1 / C_t); the two differ whenever C_t varies (Jensen).
- `group_by_layer_token` / `average_groups_across_seeds`: the layer--token-identity groups of
  subsec:error_prediction_analysis, the empirical counterpart of Eq. token_error_population_optimum:
  within a seed, average predicted and observed error over the contextual occurrences of each
  (layer, target token id); then average the group means across seeds, each seed weighted equally.
  A group absent from some seeds is averaged over the seeds that have it (the evaluation splits
  are fixed, so this only happens when populations genuinely differ); `drop_incomplete=True`
  keeps only groups present in every seed.
- `error_prediction_summary`: the three columns of tab:error_routing_transform_ablation:
  pointwise Pearson r over token positions, group Pearson r and group Spearman rho over groups.
- `decile_curve` / `plot_error_prediction`: fig:arc_error_prediction and its appendix twins.
  Equal-count bins over groups ordered by predicted error (stable argsort, np.array_split, so bin
  sizes differ by at most one and ties keep input order). Both axes are standardised with the
  TRAINING population's moments, applied unchanged to test. Legend correlations are over all
  groups, not over the ten plotted points.
- `collect_metrics` / `accuracy_table`: tab:downstream_accuracy, "mean +- sample std over seeds
  42, 43, 45", in percent with two decimals. A row is (model, method + its ablation settings off
  the defaults, `row_label`), so the runs of an ablation are separate rows.
- `token_file_errors` / `seed_error_figure`: the same groups and curves over seeds, read from the
  saved tokens-<split>.npz of each seed's run (every error-predicting layer pooled by (layer, token)); the
  curves of both populations are standardised with the seed-averaged TRAIN groups' moments.
- `final_layer_concentration`: tab:acs_concentration_diagnostics, one seed and split; the sweep
  report gives its mean +- sample std over seeds (`mean_sd`).

Std conventions: standardisation moments are population moments (ddof=0): they describe the
training population itself, not an estimate of something beyond it. Every spread reported as
uncertainty uses ddof=1: the decile whiskers are standard errors sd(ddof=1)/sqrt(n) across the
groups in a bin (NaN for a one-group bin), and table cells are sample standard deviations over
seeds, as in the paper's captions.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Iterable, NamedTuple, Sequence

import numpy as np

from minimoe.atomic import atomic_file
from minimoe.evaluation.folders import METRICS, is_run, report_evaluations

PAPER_SEEDS = (42, 43, 45)  # the seeds of the paper's accuracy tables
REQUIRED_METRICS_KEYS = ("model", "method", "dataset", "seed", "accuracy")


def _vector(name: str, values) -> np.ndarray:
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name} contains NaN or inf")
    return x


def _paired(x, y, names=("x", "y")) -> tuple[np.ndarray, np.ndarray]:
    x, y = _vector(names[0], x), _vector(names[1], y)
    if x.shape != y.shape:
        raise ValueError(f"{names[0]} and {names[1]} differ in length: {x.size} vs {y.size}")
    return x, y


# ---- correlations -------------------------------------------------------------------------------

def pearson(x, y) -> float:
    """Eq. diagnostic_concentration_loss_correlation; NaN when undefined (constant side, n < 2)."""
    x, y = _paired(x, y)
    # Test constancy by equality, not by a zero variance: the float mean of equal values can be
    # off by one ulp, which would turn an undefined correlation into noise.
    if x.size < 2 or np.all(x == x[0]) or np.all(y == y[0]):
        return float("nan")
    dx, dy = x - x.mean(), y - y.mean()
    r = float(dx @ dy / np.sqrt((dx @ dx) * (dy @ dy)))
    return max(-1.0, min(1.0, r))  # rounding can overshoot |r| = 1 on perfectly linear data


def average_ranks(x) -> np.ndarray:
    """1-based ranks; tied values share the mean of the ranks they occupy."""
    x = _vector("x", x)
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    last = np.cumsum(counts)  # rank of the last copy of each distinct value
    return ((last - counts + 1 + last) / 2.0)[inverse]


def spearman(x, y) -> float:
    x, y = _paired(x, y)
    return pearson(average_ranks(x), average_ranks(y))


# ---- affinity concentration (app:acs_concentration_diagnostics) ---------------------------------

def concentration_summary(concentration, token_ce) -> dict:
    """One checkpoint and split: C_bar, N_eff = 1 / C_bar, r(C_t, CE_t) and the token count."""
    c, ce = _paired(concentration, token_ce, ("concentration", "token_ce"))
    if c.size == 0 or np.any(c <= 0) or np.any(c > 1):
        raise ValueError("concentration must be non-empty with values in (0, 1]")
    c_bar = float(c.mean())
    return {"C_bar": c_bar, "N_eff": 1.0 / c_bar, "r": pearson(c, ce), "tokens": int(c.size)}


# ---- layer--token-identity groups (subsec:error_prediction_analysis) ----------------------------

class Groups(NamedTuple):
    predicted: np.ndarray  # (G,) mean predicted error per group
    observed: np.ndarray  # (G,) mean observed NLL per group
    keys: np.ndarray  # (G, 2) int64 rows (layer, target token id), lexicographically sorted


def _group_means(keys: np.ndarray, *columns: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    unique, inverse, counts = np.unique(keys, axis=0, return_inverse=True, return_counts=True)
    inverse = inverse.reshape(-1)  # numpy 2.x returns it with the input's trailing shape
    means = [np.bincount(inverse, weights=c, minlength=len(unique)) / counts for c in columns]
    return unique, means


def group_by_layer_token(layer, target_token, predicted, observed) -> Groups:
    """One seed: average predicted and observed error over each group's contextual occurrences."""
    pred, obs = _paired(predicted, observed, ("predicted", "observed"))
    keys = np.stack([np.asarray(layer), np.asarray(target_token)], axis=1).astype(np.int64)
    if keys.shape[0] != pred.size:
        raise ValueError(f"layer/target_token have {keys.shape[0]} entries, predicted has {pred.size}")
    unique, (pred_means, obs_means) = _group_means(keys, pred, obs)
    return Groups(pred_means, obs_means, unique)


def average_groups_across_seeds(per_seed: Sequence[Groups], *, drop_incomplete: bool = False) -> Groups:
    """Each group gets the unweighted mean of its seed means (occurrence counts do not weigh in)."""
    if not per_seed:
        raise ValueError("need the groups of at least one seed")
    keys = np.concatenate([np.asarray(g.keys, dtype=np.int64).reshape(-1, 2) for g in per_seed])
    pred = np.concatenate([np.asarray(g.predicted, dtype=np.float64) for g in per_seed])
    obs = np.concatenate([np.asarray(g.observed, dtype=np.float64) for g in per_seed])
    # Seed means are the rows here, so a plain mean over rows weights seeds equally.
    unique, (pred_means, obs_means) = _group_means(keys, pred, obs)
    if drop_incomplete:
        _, seeds_per_group = np.unique(keys, axis=0, return_counts=True)
        keep = seeds_per_group == len(per_seed)
        unique, pred_means, obs_means = unique[keep], pred_means[keep], obs_means[keep]
    return Groups(pred_means, obs_means, unique)


def group_correlations(groups: Groups) -> dict:
    return {"group_r": pearson(groups.predicted, groups.observed),
            "group_rho": spearman(groups.predicted, groups.observed),
            "groups": int(len(groups.keys))}


def error_prediction_summary(layer, target_token, predicted, observed) -> dict:
    """One seed: pointwise r over token positions plus group r and rho (tab:error_routing_transform_ablation)."""
    groups = group_by_layer_token(layer, target_token, predicted, observed)
    return {"pointwise_r": pearson(predicted, observed), "tokens": int(np.size(predicted)),
            **group_correlations(groups)}


# ---- standardised decile curves (fig:arc_error_prediction) --------------------------------------

def population_moments(predicted, observed) -> tuple[float, float, float, float]:
    """(pred_mean, pred_std, obs_mean, obs_std) with ddof=0; pass the train ones as `reference`."""
    pred, obs = _paired(predicted, observed, ("predicted", "observed"))
    return float(pred.mean()), float(pred.std()), float(obs.mean()), float(obs.std())


def _standard_error(bin_values: np.ndarray) -> float:
    if bin_values.size < 2:
        return float("nan")  # one group carries no spread estimate
    return float(bin_values.std(ddof=1) / np.sqrt(bin_values.size))


def decile_curve(predicted, observed, *, reference=None, bins: int = 10) -> dict:
    """Equal-count bins over groups ordered by predicted error, in reference-standardised units."""
    pred, obs = _paired(predicted, observed, ("predicted", "observed"))
    if pred.size < bins:
        raise ValueError(f"{pred.size} groups cannot fill {bins} non-empty bins")
    pred_mu, pred_sd, obs_mu, obs_sd = population_moments(pred, obs) if reference is None else reference
    if pred_sd <= 0 or obs_sd <= 0:
        raise ValueError(f"reference std must be positive, got pred {pred_sd}, obs {obs_sd}")
    z_pred, z_obs = (pred - pred_mu) / pred_sd, (obs - obs_mu) / obs_sd
    order = np.argsort(pred, kind="stable")
    chunks = np.array_split(order, bins)
    return {
        "pred_mean": np.array([z_pred[c].mean() for c in chunks]),
        "obs_mean": np.array([z_obs[c].mean() for c in chunks]),
        "pred_se": np.array([_standard_error(z_pred[c]) for c in chunks]),
        "obs_se": np.array([_standard_error(z_obs[c]) for c in chunks]),
        "counts": np.array([c.size for c in chunks]),
        # Over all groups, not the plotted bin means; standardisation is affine so it is moot here.
        "pearson": pearson(pred, obs),
        "spearman": spearman(pred, obs),
    }


def plot_error_prediction(train_curve: dict, test_curve: dict, path, *,
                          title: str = "Standardised aggregate error prediction") -> Path:
    """PNG in the paper's encoding: blue squares train, red circles test, whiskers +-1 SE."""
    # The object API renders with Agg without pyplot, so callers' backends and figure state stay
    # untouched and importing this module never imports matplotlib.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.0, 4.0), dpi=150)
    ax = fig.add_subplot()
    for curve, name, marker, color in ((train_curve, "train", "s", "tab:blue"),
                                       (test_curve, "test", "o", "tab:red")):
        ax.errorbar(curve["pred_mean"], curve["obs_mean"],
                    # A one-group bin has no standard error: draw it without whiskers.
                    xerr=np.nan_to_num(curve["pred_se"]), yerr=np.nan_to_num(curve["obs_se"]),
                    fmt=marker, color=color, capsize=2, linestyle="none",
                    label=f"{name}: $r_P$={curve['pearson']:.3f}, $\\rho_S$={curve['spearman']:.3f}")
    ax.set_xlabel("standardised predicted error")
    ax.set_ylabel("standardised observed NLL")
    ax.set_title(title)
    ax.legend(loc="best")
    fig.tight_layout()

    path = Path(path)
    with atomic_file(path) as tmp:  # a reader never sees a half-written PNG
        fig.savefig(tmp, format="png")
    return path


# ---- accuracy report (tab:downstream_accuracy) --------------------------------------------------

def _metrics_under(folder: Path, split: str) -> list[Path]:
    """metrics.json files under `folder`, sorted; a run folder stands for its reported evaluations only."""
    if is_run(folder):
        return report_evaluations(folder, split)
    own = [folder / METRICS] if (folder / METRICS).is_file() else []
    return own + [f for sub in sorted(folder.iterdir()) if sub.is_dir() for f in _metrics_under(sub, split)]


def metrics_files(paths: Iterable, split: str = "test") -> list[Path]:
    """metrics.json paths, or folders searched recursively -> the files, each once, in order. A run folder
    (found or given) stands for its evaluation of `split` and its zero-shot one (eval_folder.report_evaluations)."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = _metrics_under(p, split)
            if not found:
                raise FileNotFoundError(f"no {METRICS} under {p}")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"metrics path does not exist: {p}")
    unique = dict.fromkeys(f.resolve() for f in files)  # a file reached twice is read once
    return list(unique)


def collect_metrics(paths: Iterable) -> list[dict]:
    """Load metrics.json files (or directories searched recursively); adds `metrics_path`."""
    records = []
    for f in metrics_files(paths):
        record = json.loads(f.read_text())
        for key in REQUIRED_METRICS_KEYS:
            if key not in record:
                raise ValueError(f"{f}: missing required key {key!r}")
        if not isinstance(record["seed"], int) or isinstance(record["seed"], bool):
            raise ValueError(f"{f}: 'seed' must be an integer, got {record['seed']!r}")
        accuracy = record["accuracy"]
        # A fraction, not a percentage: 65.3 here would silently print as 6530.00 in the table.
        if not isinstance(accuracy, (int, float)) or not 0.0 <= accuracy <= 1.0:
            raise ValueError(f"{f}: 'accuracy' must be a fraction in [0, 1], got {accuracy!r}")
        records.append({**record, "metrics_path": str(f)})
    return records


def _cell(accuracies: list[float], seeds_asked: int) -> str:
    percent = [100.0 * a for a in accuracies]
    text = f"{statistics.fmean(percent):.2f}"
    if len(percent) > 1:
        text += f" ± {statistics.stdev(percent):.2f}"  # sample std (n - 1), as in the paper
    if len(percent) < seeds_asked:
        text += f" (n={len(percent)})"
    return text


def row_label(record: dict) -> str:
    """The method and its ablation settings off the defaults: "ACS-IS [lambda=0.01, layers=all]"."""
    settings = record.get("settings") or {}
    if not settings:
        return record["method"]
    return f"{record['method']} [" + ", ".join(f"{k}={v}" for k, v in settings.items()) + "]"


def partial_reason(record: dict, run_config: dict | None = None) -> str | None:
    """Why an evaluation (metrics.json) does not score the full split its run declares, None if it does.

    With the run's config.json: its example count for the split (train: as the run cut it) and the
    sha256 of the manifest it read. Without one: the split file's own count. Records of older
    versions lack these keys; a --max-examples cut is then taken as partial."""
    split, n = record.get("split"), record.get("n_examples")
    declared = ((run_config or {}).get("data_sizes") or {}).get(split)
    digest = ((run_config or {}).get("data_sha256") or {}).get(split)
    if declared is not None and n is not None and n != declared:
        return f"scored {n} of the run's {declared} {split} examples"
    if digest and record.get("split_sha256") and record["split_sha256"] != digest:
        return f"scored a {split} split whose sha256 is not the run's (the manifest changed since training)"
    total = record.get("split_examples")
    if declared is None and total is not None and n is not None and n < total:
        return f"scored {n} of the {total} examples of the {split} split"
    if declared is None and total is None and record.get("max_examples") is not None:
        return f"cut to --max-examples {record['max_examples']}"
    return None


def accuracy_table(records: Iterable[dict], *, seeds: Sequence[int] = PAPER_SEEDS) -> str:
    """Markdown: one row per (model, method), one column per dataset, mean ± sample std in %."""
    cells: dict[tuple, dict[tuple, float]] = {}  # (model, method) -> {(dataset, seed): accuracy}
    datasets: dict[str, None] = {}  # insertion-ordered set: columns in order of first appearance
    for r in records:
        if r["seed"] not in seeds:
            continue
        row, key = (r["model"], row_label(r)), (r["dataset"], r["seed"])
        runs = cells.setdefault(row, {})
        if key in runs:
            raise ValueError(f"duplicate run model={row[0]!r} method={row[1]!r} dataset={key[0]!r} "
                             f"seed={key[1]} (second from {r.get('metrics_path', 'an unnamed record')})")
        runs[key] = r["accuracy"]
        datasets.setdefault(r["dataset"], None)

    def escape(text) -> str:
        return str(text).replace("|", "\\|")

    # A checkpoint folder's absolute path says nothing the folder name does not (and names the machine);
    # models are shown by their last path part, in full only where two of them share it.
    models = {m for m, _ in cells}
    shown = {m: Path(m).name if sum(Path(o).name == Path(m).name for o in models) == 1 else m for m in models}
    lines = ["| Model | Method | " + " | ".join(map(escape, datasets)) + " |",
             "|---|---|" + "---|" * len(datasets)]
    for (model, method), runs in cells.items():
        row = [escape(shown[model]), escape(method)]
        for dataset in datasets:
            accs = [a for (d, _), a in runs.items() if d == dataset]
            row.append(_cell(accs, len(seeds)) if accs else "—")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


# ---- across seeds: the appendix tables and the decile figures from saved token arrays -----------

def mean_sd(values: Sequence[float], digits: int) -> str:
    """"mean ± sample std" (ddof=1) over seeds; the mean alone for one seed."""
    text = f"{statistics.fmean(values):.{digits}f}"
    return text + (f" ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else "")


def token_file_errors(path) -> tuple | None:
    """One seed's tokens-<split>.npz -> (layer, target, e_hat, token_ce) pooled over its error-predicting layers; None without e_hat."""
    with np.load(path) as z:
        layers = sorted(int(k.removeprefix("e_hat_layer")) for k in z.files if k.startswith("e_hat_layer"))
        if not layers:
            return None
        ce, target = z["token_ce"], z["target"]
        parts = [(np.full(ce.shape, l), target, z[f"e_hat_layer{l}"], ce) for l in layers]
    return tuple(np.concatenate(p) for p in zip(*parts))


def token_file_groups(path) -> Groups | None:
    errors = token_file_errors(path)
    return None if errors is None else group_by_layer_token(*errors)


def seed_error_figure(train_files, test_files, path, *, title: str, bins: int = 10) -> dict:
    """fig:arc_error_prediction over seeds: groups averaged across seeds in each population, both
    standardised with the seed-averaged TRAIN groups' moments; -> group r/rho of each population."""
    train = average_groups_across_seeds([token_file_groups(f) for f in train_files])
    test = average_groups_across_seeds([token_file_groups(f) for f in test_files])
    reference = population_moments(train.predicted, train.observed)
    curves = [decile_curve(g.predicted, g.observed, reference=reference, bins=bins) for g in (train, test)]
    plot_error_prediction(*curves, path, title=title)
    return {"train": group_correlations(train), "test": group_correlations(test)}


def final_layer_concentration(path) -> dict:
    """One seed's tokens-<split>.npz -> concentration_summary of its last diagnosed layer."""
    with np.load(path) as z:
        layer = max(int(k.removeprefix("concentration_layer")) for k in z.files if k.startswith("concentration_layer"))
        return concentration_summary(z[f"concentration_layer{layer}"], z["token_ce"])
