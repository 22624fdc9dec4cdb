"""The facts docs/ARCHITECTURE.md (and README.md's Layout table) state that drift with the code, checked against
the code: the engine-link protocol version, the import-linter contracts and the GPU worker's layers as
pyproject.toml declares them, and every file or folder the module and layer tables name. A new layer, a renamed
module or a protocol bump fails here until the design page says so."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "ftexpert"
ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"
PROCESSES = REPO / "docs" / "PROCESSES.md"
README = REPO / "README.md"

FENCE = re.compile(r"^```.*?^```[ \t]*$", re.S | re.M)
CODE = re.compile(r"`([^`]+)`")
PATHLIKE = re.compile(r"^[\w./-]+$")
SRC_PATH = re.compile(r"src/ftexpert/[\w./-]*")
# every way the pages state the engine link's protocol number (outside code blocks, which may quote an old one)
PROTOCOL_STATEMENTS = (re.compile(r"engine-link protocol (\d+)"),
                       re.compile(r"ENGINE_PROTOCOL_VERSION`?\s*(?:=|is)\s*(\d+)"),
                       re.compile(r"protocol version\s*\(?(\d+)"))


def text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def importlinter() -> dict:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["importlinter"]


def section(md: str, heading: str) -> str:
    """The body of the `heading` section (a line '#... heading'), up to the next heading of its level or above."""
    m = re.search(rf"^(#+) {re.escape(heading)}[ \t]*$", md, re.M)
    assert m, f"no section {heading!r}"
    level = len(m.group(1))
    end = re.compile(rf"^#{{1,{level}}} ", re.M).search(md, m.end())
    return md[m.end():end.start() if end else len(md)]


def first_table(body: str) -> list[list[str]]:
    """The first markdown table in `body`: its rows (header and separator left out) as cells, `\\|` unescaped."""
    lines = [ln for ln in FENCE.sub("", body).splitlines()]
    start = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    rows = []
    for ln in lines[start:]:
        if not ln.startswith("|"):
            break
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", ln.strip())[1:-1]]
        rows.append(cells)
    assert len(rows) > 2 and set(rows[1][0]) <= set("-: "), f"not a table: {rows[:2]}"
    return rows[2:]


def named_paths(cell: str) -> list[str]:
    """The files and folders a table cell names in backticks (`x.py`, `a/b.py`, `native/`); not symbols."""
    out = []
    for token in CODE.findall(cell):
        if PATHLIKE.match(token) and ("/" in token or re.search(r"\.(py|proto|c|h|md|json)$", token)):
            out.append(token)
    return out


def missing(paths: list[str], *bases: Path) -> list[str]:
    return [p for p in paths if not any((base / p).exists() for base in bases)]


# ---------------------------------------------------------------- the engine link's protocol

@pytest.mark.parametrize("page", [ARCHITECTURE, PROCESSES], ids=lambda p: p.name)
def test_the_protocol_version_stated_is_the_codes(page):
    from ftexpert.proto.engine_messages import ENGINE_PROTOCOL_VERSION

    prose = FENCE.sub("", text(page))
    stated = [int(n) for pattern in PROTOCOL_STATEMENTS for n in pattern.findall(prose)]
    assert stated, f"{page.name} states no engine-link protocol version"
    assert set(stated) == {ENGINE_PROTOCOL_VERSION}, \
        f"{page.name} states engine-link protocol {sorted(set(stated))}, the code speaks {ENGINE_PROTOCOL_VERSION}"


# ---------------------------------------------------------------- the import contracts and the layers

def test_the_contracts_named_are_pyprojects():
    body = section(text(ARCHITECTURE), "Packages are processes")
    block = re.search(r"^```text\n(.*?)^```", body, re.S | re.M)
    assert block, "ARCHITECTURE.md's 'Packages are processes' has no ```text block of contract names"
    named = [ln.strip() for ln in block.group(1).splitlines() if ln.strip()]
    assert named == [c["name"] for c in importlinter()["contracts"]]


def layer_table() -> list[list[str]]:
    return first_table(section(text(ARCHITECTURE), "The GPU worker in layers"))


def test_the_layer_table_is_the_layers_contract_in_order():
    contracts = [c for c in importlinter()["contracts"] if c["type"] == "layers"]
    assert len(contracts) == 1 and contracts[0]["containers"] == ["ftexpert.gpu_worker"]
    documented = [CODE.fullmatch(row[0]).group(1) if CODE.fullmatch(row[0]) else row[0] for row in layer_table()]
    assert documented == contracts[0]["layers"]


def test_every_module_and_subpackage_of_the_gpu_worker_is_in_a_layer():
    pkg = SRC / "gpu_worker"
    layers = {name.strip() for row in layer_table() for name in CODE.sub(r"\1", row[0]).split("|")}
    found = {p.name for p in pkg.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    found |= {p.stem for p in pkg.glob("*.py") if p.stem != "__init__"}
    assert found - layers == set(), f"undocumented in ARCHITECTURE.md's layer table: {sorted(found - layers)}"
    assert layers - found == set(), f"layers that are no module of gpu_worker: {sorted(layers - found)}"


def test_the_layer_tables_files_exist():
    paths = [p for row in layer_table() for p in named_paths(row[1])]
    assert paths, "the layer table names no file"
    assert missing(paths, SRC / "gpu_worker") == []


# ---------------------------------------------------------------- the module tables and every src/ path

def test_the_module_tables_files_exist():
    rows = first_table(section(text(ARCHITECTURE), "Modules"))
    absent = []
    for row in rows:
        folder = CODE.fullmatch(row[0])
        assert folder and folder.group(1).startswith("src/ftexpert/"), f"not a package folder: {row[0]}"
        base = REPO / folder.group(1)
        assert base.is_dir(), f"no folder {folder.group(1)}"
        paths = named_paths(row[1])
        assert paths, f"the row of {folder.group(1)} names no file"
        absent += [f"{folder.group(1)}{p}" for p in missing(paths, base)]
    assert absent == []


def test_the_module_tables_name_every_module():
    """A module or folder added to one of those packages (a new proto contract, a coordinator module) is named in
    its row, so the table says what each package holds."""
    unnamed = []
    for row in first_table(section(text(ARCHITECTURE), "Modules")):
        folder = CODE.fullmatch(row[0]).group(1)
        base = REPO / folder
        found = {p.name for p in base.glob("*.py") if p.name != "__init__.py"}
        found |= {f"{p.name}/" for p in base.iterdir() if p.is_dir() and not p.name.startswith(("__", "."))}
        unnamed += [f"{folder}{name}" for name in sorted(found - set(named_paths(row[1])))]
    assert unnamed == [], f"modules ARCHITECTURE.md's module table does not name: {unnamed}"


def test_the_package_table_lists_every_package():
    rows = first_table(section(text(ARCHITECTURE), "Packages are processes"))
    documented = {CODE.fullmatch(row[0]).group(1) for row in rows}
    packages = {f"src/ftexpert/{p.name}/" for p in SRC.iterdir() if (p / "__init__.py").exists()}
    assert documented == packages


def test_the_readme_layout_table_names_what_exists():
    """Its first column: folders and files of src/ftexpert/ (or of the repository: bench/, deploy/, docs/); the files
    its second column names, in that row's folder (or src/ftexpert/, or the repository)."""
    rows = first_table(section(text(README), "Layout"))
    absent = []
    for row in rows:
        folders = named_paths(row[0])
        assert folders, f"a Layout row names no folder: {row[0]}"
        absent += missing(folders, SRC, REPO)
        bases = [base / f for f in folders for base in (SRC, REPO)]
        absent += missing(named_paths(row[1]), *bases, SRC, REPO)
    assert absent == []
    documented = {p.split("/")[0] for row in rows for p in named_paths(row[0])}
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    assert packages - documented == set(), f"packages missing from README.md's Layout: {packages - documented}"


@pytest.mark.parametrize("page", [ARCHITECTURE, README], ids=lambda p: p.name)
def test_every_src_path_exists(page):
    paths = {m.rstrip(".,;:)/") for m in SRC_PATH.findall(text(page))}
    assert paths
    assert sorted(p for p in paths if not (REPO / p).exists()) == []


@pytest.mark.parametrize("page", [ARCHITECTURE, PROCESSES, README], ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    links = re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", text(page)))
    local = [link.split("#")[0] for link in links if not re.match(r"[a-z]+:", link) and not link.startswith("#")]
    assert sorted(link for link in local if not (page.parent / link).exists()) == []
