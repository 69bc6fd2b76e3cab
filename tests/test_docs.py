"""The documentation site (mkdocs.yml, docs/): it builds with ``mkdocs build --strict`` (a broken
link or anchor, a page left out of the nav, an unresolved reference or a module mkdocstrings
cannot read fails it), and the per-algorithm pages stay in step with ``conf/algorithm/``: one page
per config file and no other, every key of the file named on its page, every default a page's key
table gives equal to the config's (inherited keys included), every row of what the algorithm is
(``| `FedAvgServer.any_depth` | `true` |``: its server rule's class attribute, hfl.algorithm)
equal to the class's, the page's ``any_depth`` statement true, and a command that runs the algorithm."""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from hfl.config.checks import client_class

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf" / "algorithm"
PAGES = ROOT / "docs" / "algorithms"
NOT_ALGORITHMS = {"index"}  # docs/algorithms/index.md: the overview


def mkdocs() -> str | None:
    """The venv's mkdocs (beside this interpreter), else one on PATH."""
    local = Path(sys.executable).with_name("mkdocs")
    return str(local) if local.is_file() else shutil.which("mkdocs")


def algorithm_names() -> list[str]:
    return sorted(p.stem for p in CONF.glob("*.yaml"))


def own_keys(name: str) -> dict:
    """The top-level keys of conf/algorithm/<name>.yaml itself, ``defaults`` left out."""
    text = yaml.safe_load((CONF / f"{name}.yaml").read_text()) or {}
    return {k: v for k, v in text.items() if k != "defaults"}


def resolved_keys(name: str) -> dict:
    """Its keys with those of the sibling files its defaults list names (``- femam``) merged
    under them, as Hydra composes them (a sibling first, then ``_self_``)."""
    text = yaml.safe_load((CONF / f"{name}.yaml").read_text()) or {}
    merged: dict = {}
    for entry in text.get("defaults") or []:
        if isinstance(entry, str) and (CONF / f"{entry}.yaml").is_file():
            merged.update(resolved_keys(entry))
    merged.update(own_keys(name))
    return merged


def rule(name: str) -> type:
    """The algorithm's server rule (``SERVER`` of its strategy module): what it is lives there."""
    return importlib.import_module(resolved_keys(name)["strategy"]).SERVER


def client(name: str) -> type:
    """The algorithm's device client class (what ``make_client`` returns)."""
    return client_class(resolved_keys(name))


def nature(name: str, attribute: str):  # noqa: ANN201 - a class attribute's value
    """What the algorithm is, as the engine reads it (FeMAM/FeSEM's GM from their levels; the
    device's ``batched`` from its client class)."""
    if attribute == "batched":
        return client(name).batched
    server = rule(name)
    # has_global_model reads the typed keys by attribute (NodeContext.params); these are the file's own
    return server.has_global_model(SimpleNamespace(**resolved_keys(name))) if attribute == "global_model" else getattr(server, attribute)


def page(name: str) -> str:
    return (PAGES / f"{name}.md").read_text()


ROW = re.compile(r"^\|\s*`([A-Za-z_][A-Za-z0-9_]*)`\s*\|\s*`([^|]*)`\s*\|", re.MULTILINE)
NATURE_ROW = re.compile(r"^\|\s*`(\w+)\.(\w+)`\s*\|\s*`([^|]*)`\s*\|", re.MULTILINE)  # `Rule.attribute` | `value`


def table_defaults(text: str) -> list[tuple[str, str]]:
    """(key, default) of every key-table row: ``| `key` | `default` | where from |``."""
    return ROW.findall(text)


def test_mkdocs_build_strict(tmp_path):
    exe = mkdocs()
    if exe is None:
        pytest.skip("mkdocs is not installed (pip install mkdocs-material 'mkdocstrings[python]')")
    run = subprocess.run([exe, "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                          "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"
    site = tmp_path / "site"
    api = (site / "api.html").read_text()
    assert 'id="hfl.algorithm.ServerRule"' in api  # mkdocstrings rendered the protocol
    check_site_opens_as_files(site)


def check_site_opens_as_files(site: Path) -> None:
    """site/ opened in a browser as files (file://): every page's links and scripts name files that
    exist (pages as <page>.html: a link to a folder opens a listing there), the search index is a
    script beside them (Material's offline plugin: a browser refuses to fetch search_index.json
    from file://) and nothing is loaded from the network (the Web Worker shim is vendored, the fonts
    are the system's)."""
    pages = sorted(set(site.rglob("*.html")) - {site / "404.html"})  # a server's page: absolute paths
    assert len(pages) > 30 and (site / "search" / "search_index.js").read_text().startswith("var __index = {")
    missing, folders, remote = [], [], []
    for html in pages:
        text = html.read_text()
        for attr, target in re.findall(r'\b(href|src)="([^"#?]*)[^"]*"', text):
            if not target or target.startswith(("mailto:", "data:", "javascript:")):
                continue
            if re.match(r"[a-z]+://", target):
                if attr == "src" or 'rel="stylesheet" href="' + target in text:
                    remote.append((html.name, target))  # something the page loads, not a link out
                continue
            resolved = (html.parent / target).resolve()
            if target.endswith("/") or resolved.is_dir():
                folders.append((html.relative_to(site), target))
            elif not resolved.is_file():
                missing.append((html.relative_to(site), target))
    assert not missing and not folders and not remote, (missing[:10], folders[:10], remote[:10])
    index = (site / "index.html").read_text()
    assert 'src="assets/iframe-worker-shim.js"' in index and "runtimes.html" in index


ELSEWHERE: set[Path] = set()  # pages exempt from the check: none


def test_docs_cite_nothing_outside_the_repository():
    """A reader of the project has the repository, not the folder beside it: no ../shared/ or shared/ paths
    (the papers are cited by title, authors and arXiv number)."""
    texts = {p.relative_to(ROOT): p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
             if p.relative_to(ROOT) not in ELSEWHERE}
    found = [(str(path), m.group(0)) for path, text in texts.items()
             for m in re.finditer(r"(?<![\w./-])(?:\.\./)*shared/[^\s)`'\"]*", text)]
    assert not found, found


def test_one_page_per_algorithm_config():
    configs = set(algorithm_names())
    pages = {p.stem for p in PAGES.glob("*.md")} - NOT_ALGORITHMS
    assert configs, "no conf/algorithm/*.yaml found"
    assert configs - pages == set(), f"configs without a page in docs/algorithms/: {sorted(configs - pages)}"
    assert pages - configs == set(), f"pages without a conf/algorithm/*.yaml: {sorted(pages - configs)}"


def test_nav_lists_every_algorithm_page():
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [n for n in algorithm_names() if f"algorithms/{n}.md" not in nav]
    assert not missing, f"mkdocs.yml's nav lacks: {missing}"
    overview = page("index")
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| \[`(\w+)`\]\(\1\.md\).*$", overview, re.MULTILINE)}
    unlisted = [n for n in algorithm_names() if n not in rows]
    assert not unlisted, f"docs/algorithms/index.md's table does not list: {unlisted}"
    wrong = []
    for name in algorithm_names():  # its last two columns: any_depth, batched
        cells = [c.strip() for c in rows[name].strip().strip("|").split("|")]
        expected = ["true" if rule(name).any_depth else "false", "yes" if client(name).batched else "no"]
        if cells[-2:] != expected:
            wrong.append(f"{name}: {cells[-2:]} (config: {expected})")
    assert not wrong, f"docs/algorithms/index.md's any_depth / batched columns: {wrong}"


@pytest.mark.parametrize("name", algorithm_names())
def test_page_names_every_key(name):
    text = page(name)
    missing = [k for k in own_keys(name) if f"`{k}`" not in text]
    assert not missing, f"docs/algorithms/{name}.md does not mention these keys of conf/algorithm/{name}.yaml: {missing}"


@pytest.mark.parametrize("name", algorithm_names())
def test_page_defaults_match_config(name):
    keys = resolved_keys(name)
    rows = table_defaults(page(name))
    assert rows, f"docs/algorithms/{name}.md has no key table (| `key` | `default` | ... |)"
    wrong = []
    for key, shown in rows:
        if key not in keys:
            wrong.append(f"{key}: on the page, not in the config")
        elif yaml.safe_load(shown) != keys[key]:
            wrong.append(f"{key}: page {shown!r}, config {keys[key]!r}")
    assert not wrong, f"docs/algorithms/{name}.md: " + "; ".join(wrong)
    tabled = {k for k, _ in rows}
    untabled = [k for k in keys if k not in tabled]  # inherited keys too (fesem: femam's)
    assert not untabled, f"docs/algorithms/{name}.md: keys without a row in its key tables: {untabled}"


@pytest.mark.parametrize("name", algorithm_names())
def test_page_nature_rows_match_the_rule(name):
    rows = NATURE_ROW.findall(page(name))
    owner = {"batched": client(name).__name__}
    wrong = [f"{cls}.{attribute}: page {shown!r}, {owner.get(attribute, rule(name).__name__)} {nature(name, attribute)!r}"
             for cls, attribute, shown in rows
             if cls != owner.get(attribute, rule(name).__name__) or yaml.safe_load(shown) != nature(name, attribute)]
    assert not wrong, f"docs/algorithms/{name}.md: " + "; ".join(wrong)
    shown = {attribute for _, attribute, _ in rows}
    assert "personalized" in shown, f"docs/algorithms/{name}.md: no `{rule(name).__name__}.personalized` row"


@pytest.mark.parametrize("name", algorithm_names())
def test_page_states_tree_support_and_command(name):
    text = page(name)
    depth = "true" if rule(name).any_depth else "false"
    assert f"`any_depth: {depth}`" in text, f"docs/algorithms/{name}.md must state `any_depth: {depth}`"
    assert f"hfl-simulate algorithm={name}" in text, f"docs/algorithms/{name}.md has no command running it"


def test_coming_from_flower_simulation_names_what_replaces_it():
    """Flower 1.42 has no flower-simulation command (its flwr-simulation is a process the SuperLink
    starts); the page maps the old command onto hfl's, which exist."""
    bin_dir = Path(sys.executable).parent
    assert not (bin_dir / "flower-simulation").exists() and (bin_dir / "flwr-simulation").exists()
    section = (ROOT / "docs" / "runtimes.md").read_text().split("### Coming from `flower-simulation`", 1)[1].split("\n## ", 1)[0]
    assert "flower-simulation --app . --num-supernodes" in section
    assert "`hfl-deploy simulate OVERRIDES`" in section and "`hfl-simulate`" in section
    assert "#coming-from-flower-simulation" in (ROOT / "README.md").read_text()


def test_the_cpu_only_install_keeps_the_pinned_torch():
    """The documented CPU-only install puts PyTorch's CPU build first, then `pip install -c constraints.txt
    -e .`: the pins must accept the CPU builds' local versions (2.14.1+cpu), or pip would swap in CUDA."""
    from packaging.specifiers import SpecifierSet

    block = (ROOT / "docs" / "runtimes.md").read_text().split("**A CPU-only install", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    assert "--index-url https://download.pytorch.org/whl/cpu torch torchvision" in block
    assert block.index("whl/cpu") < block.index("-c constraints.txt -e .")
    pins = dict(re.findall(r"^(torch|torchvision)==(\S+)$", (ROOT / "constraints.txt").read_text(), re.MULTILINE))
    assert set(pins) == {"torch", "torchvision"}
    for name, version in pins.items():
        assert SpecifierSet(f"=={version}").contains(f"{version}+cpu"), name
