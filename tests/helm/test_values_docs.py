"""The chart README's values reference is values.yaml's `# --` comments, up to date
(helm/values_docs.py, `make chart-docs`), and every key of values.yaml has one."""

from __future__ import annotations

import importlib.util

import pytest

from tests.helm.chart import CHART_DIR, REPO


def load_generator():
    path = REPO / "helm" / "values_docs.py"
    spec = importlib.util.spec_from_file_location("values_docs", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DOCS = load_generator()


def test_the_readme_holds_the_reference_values_yaml_makes():
    readme = (CHART_DIR / "README.md").read_text()
    values = (CHART_DIR / "values.yaml").read_text()
    assert readme == DOCS.with_reference(readme, values), (
        "helm/tandem/README.md lags values.yaml: run `make chart-docs`"
    )
    assert DOCS.main(["--check"]) == 0
    # Each row names a key of values.yaml, with its default.
    assert '| `router.service.type` | string | `"ClusterIP"` |' in readme
    assert '| `prefill.acceleratorResource` | string | `"nvidia.com/gpu"` |' in readme


SAMPLE = """\
# -- The section.
#
#     example: 1
top:
  # Not part of it (above the `# --` line).
  # -- A leaf, on
  # two lines: a | b.
  leaf: x

  # -- Parted from its key by a blank line: not its description.

  other: [1]
  # -- A map documented whole; its keys need none.
  resources:
    requests: {cpu: "1"}
  list:
    - name: a
"""


def test_descriptions_are_the_comment_from_its_dash_dash_line_to_the_key():
    docs = DOCS.comments(SAMPLE)
    assert docs[("top",)] == ["The section.", "", "    example: 1"]
    assert docs[("top", "leaf")] == ["A leaf, on", "two lines: a | b."]
    assert ("top", "other") not in docs


def test_every_leaf_needs_a_comment():
    with pytest.raises(KeyError, match=r"top\.other has no `# --` comment"):
        DOCS.reference(SAMPLE)


def test_a_comment_on_no_key_of_the_values_is_refused():
    text = SAMPLE.replace("  other: [1]", "  # -- Other.\n  other: [1]").replace(
        "    - name: a", "    - name: a\n      # -- In a list entry.\n      kind: b"
    )
    with pytest.raises(KeyError, match=r"top\.list\.kind"):
        DOCS.reference(text)


def test_the_reference_is_a_section_per_key_with_examples_and_a_table():
    text = SAMPLE.replace("  other: [1]", "  # -- Other.\n  other: [1]").replace(
        "  list:\n    - name: a\n", ""
    )
    assert DOCS.reference(text).splitlines() == [
        "",
        "### `top`",
        "",
        "The section.",
        "",
        "```yaml",
        "example: 1",
        "```",
        "",
        "| Key | Type | Default | Description |",
        "|---|---|---|---|",
        '| `top.leaf` | string | `"x"` | A leaf, on two lines: a \\| b. |',
        "| `top.other` | list | `[1]` | Other. |",
        '| `top.resources` | object | `{"requests": {"cpu": "1"}}` | A map documented whole;'
        " its keys need none. |",
    ]
