"""Nothing silently wrong, nothing overwritten: one test per guarantee of the Reliability
page (docs/reliability.md). Changed settings are refused, folders are replaced only by their own kind and files only
when minimoe wrote them, partial evaluations are not counted, edited splits are refused, non-finite
training stops, a bad start leaves no folder behind, failed sweeps fail, and locks, errors and
leftovers behave."""
import json
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from minimoe.atomic import MARKER, atomic_directory
from minimoe.cli import evaluate, sweep
from minimoe.cli import train
from minimoe.core.adaptation.lora import add_lora
from minimoe.data.benchmarks import load_examples, load_split
from minimoe.data.manifests import check_disjoint
from minimoe.integrations.hf_export import export_peft
from minimoe.making.tiny import tiny_checkpoint
from minimoe.making.upcycle import upcycle
from minimoe.runs.eval_run import load_evaluation, score
from minimoe.runs.run_folder import run_lock
from minimoe.runs.training import write_selection
from minimoe.study.grid import Cell
from minimoe.study.report import report, write_report
from tests.kill import killed_after

REPO = Path(__file__).resolve().parents[1]
SMOKE = ["--batch-size", "8", "--epochs", "1", "--quiet"]  # 8 train examples: one step


def sweep_args(out, data, *flags, extra=SMOKE):
    return ["--preset", "main", "--models", str(tiny_checkpoint()), "--benchmarks", str(data), "--rows", "CE",
            "--seeds", "42", "--out-dir", str(out), *flags, "--", *extra]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, data):
    """One sweep cell trained to the end (1 epoch) in this process, as a sweep's run: (out_dir, cell)."""
    out = tmp_path_factory.mktemp("sweep")
    cell, = sweep.main(sweep_args(out, data, "--dry-run"))
    train.main(cell.train_args())
    assert cell.state() == "done"
    return out, cell


def cli(*args):
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, cwd=REPO, env=env)


def test_a_sweep_refuses_a_finished_run_made_with_other_settings_unless_rerun(tmp_path, finished, data, capsys):
    """Issue 20 item 1: the flags after -- changed (epochs, lr): the sweep names them and runs nothing;
    --dry-run shows the cell as changed; --rerun keeps the old run aside and trains the new one."""
    out, cell = finished
    run = tmp_path / "sw"
    shutil.copytree(out, run)  # the module's finished run stays as it is for the other tests
    changed = sweep_args(run, data, extra=["--batch-size", "8", "--epochs", "2", "--lr", "0.01", "--quiet"])
    with pytest.raises(SystemExit, match=r"(?s)other settings.*: epochs, lr\n.*--rerun"):
        sweep.main(changed)
    cell, = sweep.main(changed[:changed.index("--")] + ["--dry-run"] + changed[changed.index("--"):])
    assert "changed" in capsys.readouterr().out and cell.changed() == ["epochs", "lr"]
    with pytest.raises(SystemExit, match="other settings"):  # nor is the old run reported as the new one
        sweep.main(changed[:changed.index("--")] + ["--report-only"] + changed[changed.index("--"):])
    sweep.main(changed[:changed.index("--")] + ["--rerun"] + changed[changed.index("--"):])
    assert json.loads((cell.run / "config.json").read_text())["epochs"] == 2 and cell.changed() == []
    kept, = run.glob(f"{cell.run.name}.replaced-*")
    assert json.loads((kept / "config.json").read_text())["epochs"] == 1  # the old run, whole


def test_folders_are_replaced_only_by_their_kind_and_files_only_when_ours(tmp_path):
    """Issue 20 item 2 (and 5): a peft export never replaces a model folder (also one an older version
    marked "folder", as the default model is), upcycling never replaces an export, and a report never
    replaces a file minimoe did not write (README.md), while its own earlier report is replaced."""
    from minimoe.atomic import write_owned_file
    model_dir = tmp_path / "smollm2-135m-moe"
    shutil.copytree(tiny_checkpoint(), model_dir)
    (model_dir / MARKER).write_text(json.dumps({"kind": "folder"}))  # as the default model's marker reads today
    model = add_lora(train.minimoe.from_pretrained(model_dir))
    with pytest.raises(FileExistsError, match="holds minimoe's 'model' output"):
        export_peft(model, model_dir, base_model="x")
    assert (model_dir / "config.json").is_file() and not (model_dir / "adapter_model.safetensors").exists()
    export = export_peft(model, tmp_path / "export", base_model="x")
    with pytest.raises(FileExistsError, match="holds minimoe's 'peft-adapter' output"):
        upcycle(tmp_path / "missing.gguf", export)
    assert export_peft(model, export, base_model="x") == export  # the same kind: replaced

    readme = tmp_path / "README.md"
    readme.write_text("# mine\n")
    with pytest.raises(FileExistsError, match="was not written by minimoe"):
        write_owned_file(readme, "table")
    assert readme.read_text() == "# mine\n"
    write_owned_file(tmp_path / "table.md", "one")
    write_owned_file(tmp_path / "table.md", "two")  # ours: replaced
    assert (tmp_path / "table.md").read_text() == "two"
    (tmp_path / "table.md").write_text("edited by hand")
    with pytest.raises(FileExistsError, match="was changed since minimoe wrote it"):
        write_owned_file(tmp_path / "table.md", "three")

    notes = tmp_path / "notes"  # sweep --out-dir ~/notes: its report.md is the user's
    notes.mkdir()
    (notes / "report.md").write_text("my notes")
    with pytest.raises(FileExistsError, match="report.md: exists and was not written by minimoe"):
        write_report([], notes)
    assert (notes / "report.md").read_text() == "my notes" and not (notes / "report.csv").exists()


def test_reports_count_only_evaluations_of_the_whole_split(tmp_path, finished, data):
    """Issue 20 item 3: an evaluation cut by --max-examples over RUN/eval/test is listed as partial,
    not averaged in, by the sweep report and by evaluate.py report; every evaluation records the
    sha256 of the manifest it scored."""
    out, cell = finished
    run = tmp_path / cell.run.name
    shutil.copytree(cell.run, run)
    full = json.loads((run / "eval" / "test" / "metrics.json").read_text())
    config = json.loads((run / "config.json").read_text())
    import hashlib
    assert full["split_sha256"] == hashlib.sha256((data / "test.jsonl").read_bytes()).hexdigest()
    assert full["split_sha256"] == config["data_sha256"]["test"] and full["n_examples"] == 4
    cells = [Cell(cell.model, cell.data, cell.row, cell.settings, cell.seed, tmp_path)]
    assert "| CE | " in report(cells)[0] and "missing" not in report(cells)[0]
    part = score(load_evaluation(adapter=run, max_examples=2), run / "eval" / "test")
    assert part["n_examples"] == 2 and part["split_examples"] == 4
    text, rows = report(cells)
    assert "missing (0/1)" in text and rows[0]["state"] == "partial evaluation (scored 2 of the run's 4 test examples)"
    assert rows[0]["accuracy"] is None
    with pytest.raises(ValueError, match=r"partial: - .*metrics.json: scored 2 of the run's 4 test examples"):
        evaluate.main(["report", str(run / "eval"), "--seeds", "42"])
    shutil.copytree(cell.run, tmp_path / "full" / cell.run.name)  # beside a full one: counted apart, listed
    table = evaluate.main(["report", str(tmp_path), "--seeds", "42"])
    assert f"{100 * full['accuracy']:.2f}" in table and "Not counted, partial evaluations" in table


def test_an_edited_registered_split_is_refused_and_resume_refuses_other_data(tmp_path):
    """Issue 20 item 4: a registered manifest changed after splits.json recorded its sha256 is refused
    with the file named; --resume with --data-dir pointing at a (consistently) edited copy is refused."""
    splits = tmp_path / "splits"
    load_split("arc_challenge", "test", data_dir=splits)
    test = splits / "arc_challenge" / "test.jsonl"
    rows = [json.loads(line) for line in test.read_text().splitlines()]
    rows[0]["answer"] = (rows[0]["answer"] + 1) % len(rows[0]["choices"])
    original = test.read_bytes()
    test.write_text("".join(json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n" for r in rows))
    with pytest.raises(ValueError, match=f"{test}: its sha256 .* is not the .*splits.json records"):
        load_split("arc_challenge", "test", data_dir=splits)
    test.write_bytes(original)

    flags = ["--model", "tiny", "--out-dir", str(tmp_path), "--run-name", "r", "--max-train-examples", "8", *SMOKE[:2],
             "--epochs", "2", "--no-test-eval", "--quiet"]
    with pytest.raises(SystemExit, match="stopped after epoch 1"), killed_after(epochs=1):
        train.main([*flags, "--data-dir", str(splits)])
    other = tmp_path / "other"
    shutil.copytree(splits, other)
    edited = other / "arc_challenge" / "train.jsonl"
    rows = [json.loads(line) for line in edited.read_text().splitlines()]
    rows[0]["answer"] = (rows[0]["answer"] + 1) % len(rows[0]["choices"])
    edited.write_text("".join(json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n" for r in rows))
    record = json.loads((other / "arc_challenge" / "splits.json").read_text())  # consistent: passes the sha check
    record["sha256"]["train"] = __import__("hashlib").sha256(edited.read_bytes()).hexdigest()
    (other / "arc_challenge" / "splits.json").write_text(json.dumps(record))
    with pytest.raises(SystemExit, match=r"--resume with a different config: \['data_sha256'\]"):
        train.main([*flags, "--data-dir", str(other), "--resume"])


def test_non_finite_training_stops_naming_the_step_and_terms(tmp_path, data):
    """Issue 20 item 5: lambda 1e30 gives an infinite gradient norm and tau 1e-40 a NaN loss: training
    stops at step 1 with an error naming them (the untouched run folder is removed); a clipped update
    of zeros stops too; selection.json is never written with a NaN."""
    from minimoe.runs.training import NonFiniteTraining, check_step
    flags = ["--model", "tiny", "--data", str(data), "--out-dir", str(tmp_path), *SMOKE, "--no-test-eval"]
    with pytest.raises(NonFiniteTraining, match=r"step 1: non-finite .*grad_norm=(inf|nan)"):
        train.main([*flags, "--run-name", "a", "--method", "tes", "--lambda", "1e30"])
    with pytest.raises(NonFiniteTraining, match=r"step 1: non-finite .*method=nan"):
        train.main([*flags, "--run-name", "b", "--method", "tes", "--tau", "1e-40"])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.zeros(3)  # what clipping an enormous (finite) norm underflows to
    with pytest.raises(NonFiniteTraining, match="step 7: the clipped update is all zeros"):
        check_step({"task": 1.0, "grad_norm": 3e38}, [p], 7)
    p.grad = torch.tensor([0.0, 1e-3, 0.0])
    check_step({"task": 1.0, "grad_norm": 1.0}, [p], 7)  # a real update passes

    run = tmp_path / "nan"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"kind": "epoch", "epoch": 1, "val_choice_nll": NaN}\n')
    with pytest.raises(NonFiniteTraining, match=r"not finite at epoch\(s\) \[1\]"):
        write_selection(run)
    assert not (run / "selection.json").exists()


@pytest.mark.parametrize("flag, match", [
    (["--lora-targets", "nonsense"], "nonsense"),
    (["--layers", "99"], "99"),
    (["--max-length", "2"], "max_length=2 leaves no prompt token"),
    (["--lora-rank", "100000000"], "GiB in all. Lower --lora-rank"),
])
def test_every_setting_is_checked_before_the_run_folder_exists(tmp_path, data, flag, match):
    """Issue 20 item 6: each bad setting fails before the run folder is written, so the corrected
    rerun just works."""
    flags = ["--model", "tiny", "--data", str(data), "--out-dir", str(tmp_path), "--run-name", "r", *SMOKE,
             "--no-test-eval"]
    with pytest.raises(ValueError, match=match):
        train.main([*flags, *flag])
    assert not (tmp_path / "r").exists()


def test_a_start_that_fails_after_the_folder_exists_removes_it(tmp_path, data, monkeypatch):
    """Issue 20 item 6: a failure after the run folder was created (a full disk, say) and before any
    training output removes the folder it created, so the corrected command runs; --rerun then starts
    the finished run again and keeps the old one aside."""
    flags = ["--model", "tiny", "--data", str(data), "--out-dir", str(tmp_path), "--run-name", "r", *SMOKE,
             "--no-test-eval"]

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(train, "train", full_disk)
    with pytest.raises(OSError, match="No space left"):
        train.main(flags)
    assert not (tmp_path / "r").exists()
    monkeypatch.undo()
    train.main(flags)  # the corrected rerun
    assert (tmp_path / "r" / "selection.json").is_file()
    with pytest.raises(SystemExit, match="exists; pass --resume to continue it, --rerun to start it again"):
        train.main(flags)
    train.main([*flags, "--rerun"])  # a new run in the folder; the finished one is kept aside, whole
    kept, = tmp_path.glob("r.replaced-*")
    assert (kept / "selection.json").is_file() and (tmp_path / "r" / "selection.json").is_file()


def test_a_sweep_with_a_failed_run_exits_non_zero_and_bad_set_values_fail_first(tmp_path, data, capsys):
    """Issue 20 item 7: --set lambda=-1 and lambda=abc are refused before anything runs (no traceback);
    a cell whose train.py fails makes the sweep exit non-zero with a summary."""
    for value in ("-1", "abc"):
        with pytest.raises(SystemExit) as exit_:
            sweep.main(sweep_args(tmp_path, data, "--set", f"lambda={value}"))
        assert exit_.value.code == 2 and f"--set lambda={value}: " in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
    with pytest.raises(SystemExit, match=r"^sweep.py: error: 1 of 1 runs failed"):
        sweep.main(sweep_args(tmp_path, data, extra=[*SMOKE, "--lora-targets", "nonsense"]))


def test_locks_errors_and_leftovers(tmp_path, data):
    """Issue 20 item 8: the lock never follows a symlink and is never written outside a run folder;
    export.py and the upcycler fail in one line naming the file; a dead writer's temp folder goes at
    the next write beside it; train/test copies differing in whitespace or case are refused."""
    run = tmp_path / "run"
    run.mkdir()
    (run / MARKER).write_text(json.dumps({"kind": "run"}))
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (run / "train.lock").symlink_to(victim)
    with pytest.raises(OSError, match="is a symbolic link; refusing to follow it"):
        with run_lock(run):
            pass
    assert victim.read_text() == "keep me"
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_checkpoint(), model_dir)
    with pytest.raises(FileNotFoundError, match="not a train.py run folder"):
        with run_lock(model_dir):
            pass
    assert not (model_dir / "train.lock").exists()
    with pytest.raises(SystemExit, match="is not a train.py run folder"):
        train.main(["--model", "tiny", "--data", str(data), "--out-dir", str(tmp_path), "--run-name", "model",
                    "--resume"])
    assert not (model_dir / "train.lock").exists()

    out = cli("export.py", tmp_path / "nowhere", tmp_path / "exp")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [f"export.py: error: {tmp_path / 'nowhere'}: no such folder; "
                                               f"expected a run folder (config.json, checkpoints/, selection.json) "
                                               f"or an adapter folder (adapter_config.json)"]
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\0" * 40)
    out = cli("-m", "minimoe.making.upcycle", tmp_path / "bad.gguf", tmp_path / "up")
    assert out.returncode == 2 and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert out.stderr.startswith(f"upcycle: error: {tmp_path / 'bad.gguf'}: cannot be read")

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = [tmp_path / "eval" / f".test.tmp-{dead.pid}@{socket.gethostname()}-0123abcd",
             tmp_path / "eval" / f".test.tmp-{dead.pid}-0123abcd"]  # the older name
    live = tmp_path / "eval" / f".test.tmp-{os.getpid()}@{socket.gethostname()}-0123abcd"  # a writer still at work
    for folder in (*stale, live):
        folder.mkdir(parents=True)
    with atomic_directory(tmp_path / "eval" / "test", "evaluation") as tmp:
        (tmp / "metrics.json").write_text("{}")
    assert not any(p.exists() for p in stale) and live.is_dir()

    examples = load_examples("arc_challenge")[:2]
    copy = type(examples[0])(**{**asdict(examples[0]), "id": "other", "question": examples[0].question.upper() + "  "})
    with pytest.raises(ValueError, match="train and test share question and choices"):
        check_disjoint({"train": [examples[0]], "test": [copy, examples[1]]})


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_written_files_take_the_umask_as_a_plain_open_does(tmp_path, umask):
    """Issue 41 item 5: safetensors writes 0600, so adapters, checkpoints and exports were unreadable to a
    colleague under umask 022; every file minimoe writes gets 0666 less the umask, as open() gives."""
    from minimoe.atomic import atomic_file
    from minimoe.integrations.hf_export import export_merged_adapter
    from minimoe.loading.checkpoint import save_pretrained
    from minimoe.runs.adapters import save_adapter
    model = add_lora(train.minimoe.from_pretrained(tiny_checkpoint()))
    old = os.umask(umask)
    try:
        (tmp_path / "plain.txt").write_text("x")  # the reference: what a plain open gives here
        save_pretrained(model, tmp_path / "model")
        save_adapter(model, tmp_path / "adapter", base_model="x")
        export_peft(model, tmp_path / "peft", base_model="x")
        export_merged_adapter(tmp_path / "adapter", tmp_path / "merged", base_model=str(tiny_checkpoint()))
        with atomic_file(tmp_path / "report.md") as tmp:
            tmp.write_text("x")
    finally:
        os.umask(old)
    want = (tmp_path / "plain.txt").stat().st_mode & 0o777
    assert want == 0o666 & ~umask
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert {p.suffix for p in files} >= {".safetensors", ".json", ".md"}
    assert {p.relative_to(tmp_path).as_posix(): oct(p.stat().st_mode & 0o777) for p in files
            if p.stat().st_mode & 0o777 != want} == {}
