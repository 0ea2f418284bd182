"""The documentation stays true to the code: every key of deploy/visor.example.toml is explained
in its section of docs/configuration.md, every refusal reason has its row (with its status) in
docs/api.md, and every relative link in README.md and docs/ reaches an existing file and heading."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from shared.errors import STATUS_OF, Reason

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "visor.example.toml"
CONFIGURATION = ROOT / "docs" / "configuration.md"
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "bench").rglob("*.md")])


def _sections(markdown: str) -> dict[str, str]:
    """Level-2 heading -> the text up to the next level-2 heading."""
    parts = re.split(r"^## (.+)$", markdown, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def _section(markdown: str, heading: str) -> str:
    found = _sections(markdown).get(heading)
    assert found is not None, f"docs/configuration.md has no section '## {heading}'"
    return found


def _example() -> dict[str, dict[str, object]]:
    return tomllib.loads(EXAMPLE.read_text())


def _example_tenant() -> dict[str, object]:
    """The commented [[tenants]] example, uncommented (as tests/unit/test_tenants.py reads it)."""
    text = EXAMPLE.read_text()
    block = text[text.index("# [[tenants]]") :].splitlines()
    toml = "\n".join(line.removeprefix("# ") for line in block)
    row: dict[str, object] = tomllib.loads(toml.replace("<64 hex digits>", "a" * 64))["tenants"][0]
    return row


@pytest.mark.parametrize("section", list(_example()))
def test_every_example_key_is_explained_in_its_section(section: str) -> None:
    text = _section(CONFIGURATION.read_text(), f"`[{section}]`")
    missing = [key for key in _example()[section] if f"| `{key}` |" not in text]
    assert not missing, f"[{section}] keys without a row in docs/configuration.md: {missing}"


def test_every_tenant_key_is_explained() -> None:
    text = _section(CONFIGURATION.read_text(), "Tenants")
    row = _example_tenant()
    policy = row.pop("policy")
    limits = row.pop("limits")
    assert isinstance(policy, dict) and isinstance(limits, dict)
    missing = [k for k in row if not re.search(rf"`(\[\[tenants\]\] )?{k}`", text)]
    missing += [k for k in policy if f"`[tenants.policy] {k}`" not in text]
    assert not missing, f"[[tenants]] keys not explained in docs/configuration.md: {missing}"
    assert "`[tenants.limits]`" in text


def test_every_reason_has_its_row_in_the_api_docs_and_is_named_in_the_readme() -> None:
    text = (ROOT / "docs" / "api.md").read_text()
    readme = _sections((ROOT / "README.md").read_text()).get("Error reasons", "")
    for reason in Reason:
        status = STATUS_OF[reason].name
        assert f"| `{reason.value}` | {status} |" in text, f"docs/api.md: no row for {reason}"
        assert f"`{reason.value}`" in readme, f"README.md 'Error reasons' does not name {reason}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", _without_code(page.read_text()), flags=re.M):
        slug = _slug(heading)
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _without_code(markdown: str) -> str:
    return re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S)


def _links(page: Path) -> list[str]:
    targets = re.findall(r"\]\(([^)\s]+)\)", _without_code(page.read_text()))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_the_link_check_sees_the_pages_and_their_links() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "docs/configuration.md", "docs/verified.md"} <= names
    assert "docs/verified.md" in _links(ROOT / "README.md")
    assert _slug("## Structured output (`response_format`)".lstrip("# ")) == (
        "structured-output-response_format"
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_reach_a_file_and_a_heading(page: Path) -> None:
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no such heading")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"
