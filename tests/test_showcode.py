"""lab_utils.app.showcode: the "How this is measured" cells show the real source, with its place."""

from __future__ import annotations

from lab_utils.app import showcode
from lab_utils.learn import loop, ranks


def test_source_markdown_is_the_functions_own_code_with_file_and_line():
    md = showcode.source_markdown(loop.run_epoch)
    assert md.startswith("**`lab_utils.learn.loop.run_epoch`** (lab_utils/learn/loop.py, line ")
    assert "def run_epoch(" in md and "train_steps(" in md
    assert md.rstrip().endswith("```")
    line = int(md.split("line ", 1)[1].split(")", 1)[0])
    src = (showcode.Path(loop.__file__)).read_text().splitlines()
    assert src[line - 1].startswith("def run_epoch(")


def test_show_source_displays_every_function(monkeypatch):
    shown = []
    monkeypatch.setattr(showcode, "display", shown.append)
    showcode.show_source(loop.train_steps, ranks.aggregate_epoch)
    [md] = shown
    assert ("lab_utils.learn.loop.train_steps" in md.data
            and "lab_utils.learn.ranks.aggregate_epoch" in md.data)
