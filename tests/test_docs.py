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
    quickstart = text[text.index("## Quickstart (CPU)"):text.index("**On a GPU:**")]
    code = "\n".join(re.findall(r"^```bash\n(.*?)^```", quickstart, flags=re.M | re.S))
    installs = re.findall(r"pip install (torch\S*[^&]*)", code)
    assert len(installs) >= 2, f"the quickstart's commands install torch {len(installs)} times; expected both"
    assert all(f"torch==2.13.0 {CPU_INDEX}" == i.strip() for i in installs), installs
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r"^TORCH=\(torch==2\.13\.0 " + re.escape(CPU_INDEX) + r"\)$", ci, re.M), \
        ".ci/run does not install torch from the CPU index as the README does"
    assert "install.md#the-tests-two-environments" in quickstart, "the quickstart does not link the versions tested"
