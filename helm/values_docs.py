"""Write the values reference of helm/tandem/README.md from values.yaml's comments.

The convention is helm-docs' (production-stack's and llm-d's charts use it):
the comment block right above a key, from its `# --` line on, describes the
key; lines above the `# --` line, or parted from the key by a blank line, are
not part of it. A key with documented keys under it is a heading (top level)
or a row of its own (below); every other key, a leaf (a scalar, a list, or a
map documented as a whole, such as `resources`), must be documented. In a
description, lines indented by four spaces more are an example, shown as a
YAML block (for a section) or code (for a row).

The reference goes between README's two markers: per top-level key a heading,
its description, then a table of its keys (key, type, default, description).

    python helm/values_docs.py           # rewrite README.md's values reference
    python helm/values_docs.py --check   # exit 1 if it is out of date

`make chart-docs` runs the first; tests/helm/test_values_docs.py the check.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, NamedTuple

import yaml

ROOT = Path(__file__).resolve().parents[1]
VALUES = ROOT / "helm" / "tandem" / "values.yaml"
README = ROOT / "helm" / "tandem" / "README.md"
START = (
    "<!-- values reference: generated from values.yaml's `# --` comments by "
    "`make chart-docs` (helm/values_docs.py); edit those, not this -->"
)
END = "<!-- end of values reference -->"
KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_./-]+):(?:\s|$)")
EXAMPLE_INDENT = "    "

Path_ = tuple[str, ...]


def comments(text: str) -> dict[Path_, list[str]]:
    """Each documented key's path and its description's lines (`# -- ` dropped)."""
    out: dict[Path_, list[str]] = {}
    stack: list[tuple[int, str]] = []
    block: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            block.append(stripped[2:] if stripped.startswith("# ") else stripped[1:])
            continue
        match = KEY.match(line)
        if match is None or stripped.startswith("-"):
            block = []  # a blank line, a list item: no key of its own
            continue
        indent = len(match["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, match["key"]))
        starts = [i for i, c in enumerate(block) if c.startswith("-- ")]
        if starts:
            lines = block[starts[-1] :]
            out[tuple(k for _, k in stack)] = [lines[0][3:], *lines[1:]]
        block = []
    return out


class Row(NamedTuple):
    key: str
    type: str
    default: str
    description: list[str]


def type_name(value: Any) -> str:
    for kind, name in ((bool, "bool"), (int, "int"), (float, "float"), (str, "string")):
        if isinstance(value, kind):
            return name
    return "list" if isinstance(value, list) else "object" if isinstance(value, dict) else "null"


def rows(values: dict[str, Any], docs: dict[Path_, list[str]], path: Path_) -> list[Row]:
    """The rows of the keys under `path`, depth first; KeyError naming an undocumented leaf."""
    out = []
    for key, value in values.items():
        here = (*path, key)
        parent = isinstance(value, dict) and any(p[: len(here)] == here for p in docs if p != here)
        if not parent and here not in docs:
            raise KeyError(f"values.yaml: {'.'.join(here)} has no `# --` comment")
        if here in docs:
            default = "" if parent else f"`{json.dumps(value, ensure_ascii=False)}`"
            out.append(Row(".".join(here), type_name(value), default, docs[here]))
        if parent:
            out += rows(value, docs, here)
    return out


def prose(text: str) -> str:
    """`text` safe in Markdown: `<name>` outside code spans is not taken for HTML."""
    parts = text.split("`")
    parts[::2] = [p.replace("<", "&lt;").replace(">", "&gt;") for p in parts[::2]]
    return "`".join(parts)


def cell(text: str) -> str:
    return prose(text).replace("|", "\\|")


def one_line(lines: list[str]) -> str:
    """A description as one table cell: examples as code."""
    parts = [
        f"`{line.strip()}`" if line.startswith(EXAMPLE_INDENT) else line.strip() for line in lines
    ]
    return cell(" ".join(p for p in parts if p))


def paragraphs(lines: list[str]) -> list[str]:
    """A section's description as Markdown: prose, and examples as YAML blocks."""
    out: list[str] = []
    example = False
    for line in lines:
        is_example = line.startswith(EXAMPLE_INDENT)
        if is_example != example:
            out += ["```yaml"] if is_example else ["```"]
            example = is_example
        out.append(line[len(EXAMPLE_INDENT) :] if is_example else prose(line))
    if example:
        out.append("```")
    return out


def reference(values_text: str) -> str:
    """The values reference, from values.yaml's text."""
    values = yaml.safe_load(values_text)
    docs = comments(values_text)
    stray = [".".join(p) for p in docs if not _resolves(values, p)]
    if stray:
        raise KeyError(f"values.yaml: `# --` comments on no key of the values: {stray}")
    out: list[str] = []
    for key, value in values.items():
        out += ["", f"### `{key}`", ""]
        if (key,) in docs:
            out += [*paragraphs(docs[(key,)]), ""]
        section = rows({key: value}, docs, ())
        table = [r for r in section if r.key != key] or section
        out += ["| Key | Type | Default | Description |", "|---|---|---|---|"]
        for row in table:
            described = "(above)" if row.key == key else one_line(row.description)
            default = row.default.replace("|", "\\|")  # code: no HTML to escape
            out.append(f"| `{row.key}` | {row.type} | {default} | {described} |")
    return "\n".join(out) + "\n"


def _resolves(values: Any, path: Path_) -> bool:
    for key in path:
        if not isinstance(values, dict) or key not in values:
            return False
        values = values[key]
    return True


def with_reference(readme: str, values_text: str) -> str:
    """`readme` with the text between its markers replaced by the reference."""
    head, start, rest = readme.partition(START)
    _, end, tail = rest.partition(END)
    if not start or not end:
        raise ValueError(f"{README}: the markers {START!r} and {END!r} are missing")
    return head + START + "\n" + reference(values_text) + "\n" + END + tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check; exit 1 when stale")
    args = parser.parse_args(argv)
    text = README.read_text()
    want = with_reference(text, VALUES.read_text())
    if args.check:
        if text != want:
            print(f"{README} is stale: run `make chart-docs`", file=sys.stderr)
            return 1
        return 0
    README.write_text(want)
    return 0


if __name__ == "__main__":
    sys.exit(main())
