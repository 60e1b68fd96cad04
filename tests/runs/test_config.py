"""minimoe.runs.config against the paper's Experimental Configuration table (written out here): the recipes,
the training examples and steps per epoch they give through train.py, and run names."""
import pytest

from minimoe.cli import train
from tests.conftest import tiny_config
from minimoe.data.benchmarks import BENCHMARKS, Example
from minimoe.runs.compat import settings_of
from minimoe.runs.config import differing, flag_name, method_for, method_settings, recipe_train_examples
from minimoe.runs.naming import ABLATION_SETTINGS, run_name
from minimoe.runs.training import steps_per_epoch
from minimoe.study.grid import ROWS

# The paper's Table "Experimental Configuration", value by value (ARC = ARC-Challenge).
PAPER = {
    "granite": dict(train_examples={"arc_challenge": 2000, "openbookqa": 4992, "sciq": 4992, "medmcqa": 4992},
                    steps_per_epoch={"arc_challenge": 125, "openbookqa": 312, "sciq": 312, "medmcqa": 312},
                    lora_rank=8, lora_alpha=8, lora_dropout=0.05, lora_targets={"q", "k", "v", "experts"},
                    lr=1e-4, batch_size=8, grad_accum=2, schedule="cosine", warmup=0.05, weight_decay=0,
                    clip=1, epochs=3),
    "olmoe": dict(train_examples={"arc_challenge": 2000, "openbookqa": 5000, "sciq": 5000, "medmcqa": 5000},
                  steps_per_epoch={"arc_challenge": 250, "openbookqa": 625, "sciq": 625, "medmcqa": 625},
                  lora_rank=8, lora_alpha=8, lora_dropout=0.05, lora_targets={"q", "k", "v", "o", "experts"},
                  lr=2e-5, batch_size=8, grad_accum=1, schedule="linear", warmup=0.03, weight_decay=0,
                  clip=1, epochs=3),
}
# Method rows: lambda_m 1e-3, error-head LR 1e-5, copied-head LR 1e-3, mixing 0.5, started log with
# gamma = tau = 1, final sparse layer, native router frozen, auxiliary loss 0, IS floor 1e-8.
PAPER_METHODS = dict(lambda_=1e-3, error_head_lr=1e-5, copied_head_lr=1e-3, mix=0.5, transform="started-log",
                     gamma=1, tau=1, layers="final", tune_router=False, aux_coef=0, is_eps=1e-8)


def model_config(recipe):
    return tiny_config("granitemoe" if recipe == "granite" else "olmoe")


def resolved(recipe, *flags):
    return train.resolve_config(train.parse_args(["--recipe", recipe, *flags]), model_config(recipe))


def setting(cfg, key):
    """A setting of the resolved run: its field, one of its configured method's (method_settings), or that
    method's option (its values hold every one the method reads; the others at their records' defaults)."""
    settings = {**vars(cfg), **method_settings(cfg.method)}
    if key in settings:
        return settings[key]
    from minimoe.core.routing_methods.methods import METHODS
    return cfg.method.values.get(key, next(m.settings[key] for m in METHODS.values() if key in m.settings))


def name(settings):
    """run_name of a sweep cell's settings, its method resolved from them as train.py resolves it."""
    return run_name(settings, method_for(settings_of(settings)))


@pytest.mark.parametrize("recipe", PAPER)
def test_recipes_are_the_papers_configuration(recipe):
    paper, cfg = PAPER[recipe], resolved(recipe)
    for key in ("lora_rank", "lora_alpha", "lora_dropout", "lr", "batch_size", "grad_accum", "schedule", "warmup",
                "weight_decay", "clip", "epochs"):
        assert getattr(cfg, key) == paper[key], key
    assert set(cfg.lora_targets) == paper["lora_targets"]
    for key, value in PAPER_METHODS.items():
        assert setting(cfg, key) == value, key


@pytest.mark.parametrize("recipe", PAPER)
@pytest.mark.parametrize("dataset", ["arc_challenge", "openbookqa", "sciq", "medmcqa"])
def test_training_examples_and_steps_per_epoch_are_the_papers(recipe, dataset, monkeypatch):
    """Through train.py's own path: registered split (shared by the backbones) -> recipe cut -> steps."""
    sizes = {"train": BENCHMARKS[dataset].train_size, "val": 50, "test": 500}
    monkeypatch.setattr(train, "load_split",
                        lambda name, split, **kw: [Example(f"{name}:{split}:{i}", f"q {split} {i}", ["a", "b"], 0, {})
                                                   for i in range(sizes[split])])
    cfg = resolved(recipe, "--data", dataset)
    data, cfg = train.load_data(cfg)
    assert len(data["train"]) == PAPER[recipe]["train_examples"][dataset]
    assert steps_per_epoch(len(data["train"]), cfg) == PAPER[recipe]["steps_per_epoch"][dataset]
    assert cfg.max_train_examples == len(data["train"])  # recorded: evaluation's train population is the same


def test_partial_last_step_is_kept_and_flags_override_the_recipe_count(monkeypatch):
    cfg = resolved("granite")
    assert steps_per_epoch(5000, cfg) == 313  # 312 full steps of 16 and one of 8: every example once
    assert recipe_train_examples(resolved("tiny"), "sciq") is None
    # --max-train-examples over the recipe's 4992 SciQ examples, below and above it, through train.py's own path
    sizes = {"train": 6000, "val": 4, "test": 4}
    monkeypatch.setattr(train, "load_split", lambda name, split, **kw: [
        Example(f"{name}:{split}:{i}", f"q {split} {i}", ["a", "b"], 0, {}) for i in range(sizes[split])])
    for asked in (100, 5500):
        data, cfg = train.load_data(resolved("granite", "--data", "sciq", "--max-train-examples", str(asked)))
        assert len(data["train"]) == cfg.max_train_examples == asked
        assert steps_per_epoch(len(data["train"]), cfg) == -(-asked // 16)



def test_a_different_seed_is_a_different_run():
    """--resume and the sweep compare runs with `differing`: the seed decides the run (data order, LoRA init,
    dropout), so seeds 42 and 43 differ in it, and in it alone."""
    a, b = resolved("olmoe", "--seed", "42"), resolved("olmoe", "--seed", "43")
    assert differing(a, b) == ["seed"] and differing(a, a) == []


def test_run_names_carry_ablation_settings_off_their_defaults():
    base = {"model": "org/granite-x", "data": "arc_challenge", "method": "tes", "objective": "is", "seed": 42}
    assert name(base) == "granite-x-arc_challenge-TES-IS-seed42"
    assert name({**base, "lambda_": 1e-3, "layers": "final"}) == name(base)  # defaults stay out
    names = {name({**base, **s}) for s in ({"lambda_": 1e-2}, {"layers": "all"}, {"transform": "log"},
                                                {"gamma": 2.0}, {"error_head_lr": 1e-4}, {"depth_scaled_lambda": True},
                                                {"layers": "all", "depth_scaled_lambda": True}, {})}
    assert len(names) == 8
    assert name({**base, "lambda_": 1e-2, "layers": "all"}) == "granite-x-arc_challenge-TES-IS-lambda0.01-layersall-seed42"
    # A setting the method does not read is no part of its name: CE at lambda 1e-2 is the CE run.
    ce = {**base, "method": "ce"}
    assert name({**ce, "lambda_": 1e-2, "gamma": 2.0}) == name(ce)


def test_flag_name_is_train_pys_flag_for_every_setting_a_sweep_cell_passes():
    """A cell passes its row's and its ablation settings' fields as train.py flags (flag_name): each must
    be the flag train.py's parser takes for that field, lambda_ included."""
    from minimoe.runs.config import FIELDS
    parser = train.parser()
    options = {option: action.dest for action in parser._actions for option in action.option_strings}
    fields = {*ABLATION_SETTINGS, *(key for row in ROWS.values() for key in row)}
    assert {flag_name(key): key for key in fields if key in FIELDS}.items() <= options.items()
    for key in fields - set(FIELDS):  # a method option (gamma): its flag sets that option of method_options
        value = {"transform": "log", "esft_criterion": "gate", "esft_p": "0.5", "esft_form": "full"}.get(key, "2")
        assert parser.parse_args([flag_name(key), value]).method_options.keys() == {key}


def test_every_built_in_method_setting_is_a_flag_made_from_its_record():
    """methods.METHODS holds each built-in option's and head learning rate's default, once: train.py's flag
    of that name is made from the record (its help shows the record's default) and sets that option of
    method_options, and TrainConfig has no field of that name, so nothing can drift from the record."""
    from minimoe.core.routing_methods.methods import METHODS
    from minimoe.runs.config import TrainConfig
    parser = train.parser()
    settings = {k: v for m in METHODS.values() if m.module is None for k, v in m.settings.items()}
    assert set(settings) == {"gamma", "tau", "transform", "mix", "error_head_lr", "copied_head_lr", "esft_criterion",
                             "esft_p", "esft_form", "esft_lr"}
    for name, default in settings.items():
        action = parser._option_string_actions[flag_name(name)]
        assert f"(default: {default})" in action.help and not hasattr(TrainConfig, name), name
        assert parser.parse_args([flag_name(name), str(default)]).method_options == {name: default}, name


def test_an_unknown_method_lists_ce_as_the_readme_names_it():
    """Issue 41 item 7: --method tess listed ['native', 'dual', 'tes', 'acs'], not the README's `ce`."""
    from minimoe.core.routing_methods.methods import get_method
    with pytest.raises(ValueError, match=r"unknown method 'tess'; expected .*'ce'"):
        get_method("tess")


@pytest.mark.parametrize("method, flags, warned", [("ce", ["--objective", "enll"], "--objective"),
                                                   ("dual", ["--lambda", "0.01"], "--lambda"),
                                                   ("tes", ["--objective", "enll"], None), ("ce", [], None)])
def test_a_supervision_flag_that_the_method_does_not_read_is_said_ignored(tmp_path, capsys, method, flags, warned):
    """Issue 41 item 7: --method ce --objective enll was accepted silently; CE has no objective. It is
    said to be ignored (not refused: a sweep's common flags reach CE rows too)."""
    train.main(["--model", "tiny", "--method", method, *flags, "--epochs", "1", "--max-train-examples", "8",
                "--batch-size", "8", "--no-test-eval", "--quiet", "--out-dir", str(tmp_path), "--run-name", "r",
                "--data-dir", str(tmp_path / "splits")])
    lines = [line for line in capsys.readouterr().err.splitlines() if "ignored" in line]
    label = "CE" if method == "ce" else "Dual Affinity"
    assert lines == ([f"train.py: warning: {warned} ignored: {label} supervises no prediction, so it has no "
                      f"objective nor lambda (TES and ACS do)"] if warned else [])


@pytest.mark.parametrize("flags, warned", [
    (["--method", "ce", "--esft-p", "0.3", "--esft-form", "full"], "--esft-p, --esft-form ignored: options of other methods"),
    (["--method", "router", "--lora-targets", "q,v"], "--lora-targets ignored: Router only trains no LoRA"),
    (["--method", "esft", "--esft-form", "full", "--lora-targets", "q,v"], "--lora-targets ignored: ESFT trains no LoRA"),
    (["--method", "esft", "--lora-targets", "experts"], None),  # the LoRA form trains the chosen experts' LoRA
])
def test_a_flag_that_changes_nothing_is_said_ignored(tmp_path, capsys, flags, warned):
    """Issue 57 item 3: another method's options, and --lora-targets where no LoRA trains, were taken without a
    word; train.py says once that they are ignored and why (not refused, as the supervision flags above)."""
    train.main(["--model", "tiny", *flags, "--epochs", "1", "--max-train-examples", "8", "--batch-size", "8",
                "--no-test-eval", "--quiet", "--out-dir", str(tmp_path), "--run-name", "r",
                "--data-dir", str(tmp_path / "splits")])
    lines = [line for line in capsys.readouterr().err.splitlines() if "ignored" in line]
    assert len(lines) == (1 if warned else 0) and (not warned or lines[0].startswith(f"train.py: warning: {warned}")), lines
